"""Loading fails early and clearly: missing, truncated or unknown files name the problem."""

from __future__ import annotations

import shutil
from pathlib import Path

import onnx
import pytest

from engine import ModelLoadError, Translator
from engine.model import files
from engine.model.kv.slots.pool import SlotGraphs
from engine.model.layouts import DecoderLayout
from tests.conftest import FIXTURE_MODEL, model_copy, needs_fixture


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    needs_fixture()
    return model_copy(
        tmp_path / "model",
        {
            name: FIXTURE_MODEL / name
            for name in ("encoder_model.onnx", "decoder_model_merged.onnx")
        },
    )


def test_onnx_subfolder_layout(tmp_path: Path) -> None:
    needs_fixture()
    root = model_copy(tmp_path / "hub", {})
    (root / "onnx").mkdir()
    for name in ("encoder_model.onnx", "decoder_model_merged.onnx"):
        shutil.copy(FIXTURE_MODEL / name, root / "onnx" / name)
    tr = Translator.from_dir(root, prefer_split=False)
    assert tr.model.layout is DecoderLayout.MERGED
    assert tr.translate(["I will meet Tom at three"])[0].text


def test_quantized_files_are_chosen_by_option() -> None:
    needs_fixture()
    tr = Translator.from_dir(FIXTURE_MODEL, quantized=True)
    assert tr.model.files["encoder"].name == "encoder_model_quantized.onnx"
    assert tr.model.files["no_past"].name == "decoder_model_quantized.onnx"
    assert tr.model.files["with_past"].name == "decoder_with_past_model_quantized.onnx"
    merged = Translator.from_dir(FIXTURE_MODEL, quantized=True, prefer_split=False)
    assert merged.model.files["no_past"].name == "decoder_model_merged_quantized.onnx"
    assert merged.translate(["we eat noodles"])[0].text == tr.translate(["we eat noodles"])[0].text
    assert tr.translate(["we eat noodles"])[0].text


@pytest.mark.parametrize(
    "victim",
    ["encoder_model.onnx", "decoder_model_merged.onnx", "config.json", "vocab.json", "source.spm"],
)
def test_missing_file_is_named(model_dir: Path, victim: str) -> None:
    (model_dir / victim).unlink()
    with pytest.raises(ModelLoadError) as err:
        Translator.from_dir(model_dir)
    message = str(err.value)
    assert str(model_dir) in message
    assert victim.removesuffix(".onnx").split("_model")[0] in message


@pytest.mark.parametrize(
    "victim", ["encoder_model.onnx", "decoder_model_merged.onnx", "target.spm", "vocab.json"]
)
def test_truncated_file_is_named(model_dir: Path, victim: str) -> None:
    path = model_dir / victim
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    with pytest.raises(ModelLoadError) as err:
        Translator.from_dir(model_dir)
    assert victim in str(err.value) and str(model_dir) in str(err.value)


def test_missing_quantized_files(model_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"encoder_model_quantized\.onnx"):
        Translator.from_dir(model_dir, quantized=True)


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a model directory"):
        Translator.from_dir(tmp_path / "nowhere")


def test_unknown_decoder_signature_names_missing_inputs(model_dir: Path) -> None:
    from onnx import TensorProto, helper

    # A decoder missing one layer's encoder KV inputs: close to "merged", but not it.
    layers = Translator.from_dir(model_dir).config.decoder_layers
    names = ["encoder_attention_mask", "input_ids", "encoder_hidden_states", "use_cache_branch"]
    for i in range(layers):
        names += [f"past_key_values.{i}.decoder.key", f"past_key_values.{i}.decoder.value"]
        if i:
            names += [f"past_key_values.{i}.encoder.key", f"past_key_values.{i}.encoder.value"]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names]
    out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)
    graph = helper.make_graph(
        [helper.make_node("Identity", ["encoder_hidden_states"], ["logits"])], "g", inputs, [out]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(model_dir / "decoder_model_merged.onnx"))
    with pytest.raises(ModelLoadError) as err:
        Translator.from_dir(model_dir)
    message = str(err.value)
    assert "past_key_values.0.encoder.key" in message
    assert "past_key_values.0.encoder.value" in message
    assert "missing inputs" in message


def test_ir10_files_load(tmp_path: Path) -> None:
    """Exports made with onnx >= 1.16 (e.g. onnx-community's opus-mt repos) are IR 10, which
    onnxruntime < 1.18 refuses (microsoft/onnxruntime#20559): the fixture re-saved as IR 10
    must load and translate exactly as the committed IR 8 files."""
    needs_fixture()
    names = ("encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx")
    model_dir = model_copy(tmp_path / "ir10", {})
    for name in names:
        model = onnx.load(str(FIXTURE_MODEL / name))
        assert model.ir_version < 10  # otherwise this test proves nothing
        model.ir_version = 10
        onnx.save(model, str(model_dir / name))
        assert onnx.load(str(model_dir / name)).ir_version == 10
    sources = ["I will meet Tom at three", "Tom reads a book in the library"]
    ir10 = Translator.from_dir(model_dir).translate(sources)
    committed = Translator.from_dir(FIXTURE_MODEL).translate(sources)
    assert [r.token_ids for r in ir10] == [r.token_ids for r in committed]


def test_a_with_past_decoder_that_also_declares_encoder_states_gets_its_encoder_kv(
    tmp_path: Path,
) -> None:
    """Some exports' decoder_with_past declares `encoder_hidden_states` beside the encoder
    KV inputs it needs: it must get the KV (fed the states alone, ORT says "Required inputs
    missing" at step 1), and the states too since it declares them."""
    needs_fixture()
    names = ("encoder_model.onnx", "decoder_model.onnx")
    model_dir = model_copy(tmp_path / "states", {n: FIXTURE_MODEL / n for n in names})
    step = onnx.load(str(FIXTURE_MODEL / "decoder_with_past_model.onnx"))
    assert "encoder_hidden_states" not in {i.name for i in step.graph.input}
    first = onnx.load(str(FIXTURE_MODEL / "decoder_model.onnx"))
    states = next(i for i in first.graph.input if i.name == "encoder_hidden_states")
    step.graph.input.append(states)  # declared, unused
    onnx.save(step, str(model_dir / "decoder_with_past_model.onnx"))
    tr = Translator.from_dir(model_dir)
    assert tr.model.layout is DecoderLayout.SPLIT
    sources = ["I will meet Tom at three", "Tom reads a book in the library"]
    committed = Translator.from_dir(FIXTURE_MODEL).translate(sources)
    assert [r.token_ids for r in tr.translate(sources)] == [r.token_ids for r in committed]


@pytest.mark.parametrize("quantized", [False, True])
def test_a_merged_only_model_is_split_at_load_and_decodes_the_same(
    tmp_path: Path, quantized: bool
) -> None:
    """Pulled models have only the merged decoder: its two If branches run as the split
    pair (no If per step), checked against the merged graph at load."""
    needs_fixture()
    suffix = "_quantized" if quantized else ""
    names = (f"encoder_model{suffix}.onnx", f"decoder_model_merged{suffix}.onnx")
    model_dir = model_copy(tmp_path / "merged", {n: FIXTURE_MODEL / n for n in names})
    split = Translator.from_dir(model_dir, quantized=quantized)
    assert split.model.layout is DecoderLayout.SPLIT and split.model.split_at_load
    with_if = Translator.from_dir(model_dir, quantized=quantized, prefer_split=False)
    assert with_if.model.layout is DecoderLayout.MERGED
    sources = ["I will meet Tom at three", "Did Mary call my friend yesterday", "Tom"]
    got, want = split.translate(sources), with_if.translate(sources)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_a_split_that_disagrees_with_the_merged_graph_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Branches that do not give the merged decoder's logits are not used: one log line,
    and the merged file runs as it is."""
    needs_fixture()
    step = onnx.load(str(FIXTURE_MODEL / "decoder_with_past_model.onnx"))
    for init in step.graph.initializer:
        if init.name == "final_logits_bias":
            bias = onnx.numpy_helper.to_array(init).copy()
            bias[0, 7] += 100.0
            init.CopyFrom(onnx.numpy_helper.from_array(bias, init.name))
    wrong = ((FIXTURE_MODEL / "decoder_model.onnx").read_bytes(), step.SerializeToString())
    monkeypatch.setattr(files, "split_merged", lambda path: wrong)
    names = ("encoder_model.onnx", "decoder_model_merged.onnx")
    model_dir = model_copy(tmp_path / "merged", {n: FIXTURE_MODEL / n for n in names})
    with caplog.at_level("WARNING", logger="engine.model.load"):
        tr = Translator.from_dir(model_dir)
    assert tr.model.layout is DecoderLayout.MERGED and not tr.model.split_at_load
    assert any("keeping the merged file" in r.getMessage() for r in caplog.records)
    assert tr.translate(["I will meet Tom at three"])[0].text


@pytest.mark.parametrize("prefer_split", [True, False])
def test_a_merged_decoder_is_split_once_per_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefer_split: bool
) -> None:
    """The split pair (split at load) and the masks rewrite (continuous batching) take the
    same branches: the merged file is cut apart once per load, whoever needs it."""
    needs_fixture()
    names = ("encoder_model.onnx", "decoder_model_merged.onnx")
    model_dir = model_copy(tmp_path / "merged", {n: FIXTURE_MODEL / n for n in names})
    splits: list[Path] = []
    real = files.split_merged

    def counted(path: Path) -> tuple[bytes, bytes] | None:
        splits.append(path)
        return real(path)

    monkeypatch.setattr(files, "split_merged", counted)
    tr = Translator.from_dir(model_dir, prefer_split=prefer_split)
    assert tr.model.batching == "continuous"
    assert tr.model.split_at_load is prefer_split
    assert splits == [model_dir / "decoder_model_merged.onnx"]
    splits.clear()
    Translator.from_dir(model_dir, prefer_split=prefer_split, batchable=False)
    assert len(splits) == (1 if prefer_split else 0)


def test_sessions_do_not_keep_the_graphs_they_were_opened_from() -> None:
    """A session opened from a serialised graph (every rewritten decoder graph) drops it
    once open: ONNX Runtime's Python session would keep it for a provider fallback, as
    much memory again as the model; and on the CPU, where the scheduler copies the state
    by default, no graphs over KV slots are built (asked for, they are)."""
    needs_fixture()
    import gc

    import onnxruntime as ort

    from engine.decoding.scheduler import SchedulerOptions

    tr = Translator.from_dir(FIXTURE_MODEL, quantized=True)
    masked = tr.model.masked
    assert masked is not None and not isinstance(tr.model.kv, SlotGraphs)
    sessions = [o for o in gc.get_objects() if isinstance(o, ort.InferenceSession)]
    assert sessions
    assert all(getattr(s, "_model_bytes", None) is None for s in sessions)
    # Still usable: they run, and the model translates.
    assert tr.translate(["Hello world."])[0].token_ids
    asked = Translator.from_dir(FIXTURE_MODEL, scheduler=SchedulerOptions(lanes=1, kv_slots=2))
    assert isinstance(asked.model.kv, SlotGraphs)
    assert asked.scheduler.kv_slots is not None


def test_sessions_share_one_cpu_arena_unless_told_not_to() -> None:
    """Each session's own arena keeps its largest blocks for its life; by default every
    session allocates from one registered for the process (`shared_cpu_arena`)."""
    from engine.model.sessions import RuntimeOptions, session_options, shared_cpu_arena

    assert shared_cpu_arena() and shared_cpu_arena()  # registered once, then reused
    shared = session_options(RuntimeOptions())
    own = session_options(RuntimeOptions(shared_arena=False))
    assert shared.get_session_config_entry("session.use_env_allocators") == "1"
    with pytest.raises(RuntimeError):  # never set
        own.get_session_config_entry("session.use_env_allocators")
