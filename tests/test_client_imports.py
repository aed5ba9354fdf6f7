"""A client is only a client: `RemoteTranslator`, the bridges and the protocol import without
ONNX Runtime or the engine's model, decoding and streaming layers, so a speech pipeline that
talks to a server installs and starts like any WebSocket client. `engine` itself loads its
public names on first use, so `import engine` is light too."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

HEAVY = ("onnxruntime", "sentencepiece", "engine.model", "engine.decoding", "engine.streaming")


def loaded_after(statement: str) -> list[str]:
    """The heavy modules in `sys.modules` after running `statement` in a fresh interpreter."""
    code = (
        "import json, sys\n"
        f"{statement}\n"
        f"heavy = {HEAVY!r}\n"
        "print(json.dumps(sorted(m for m in sys.modules"
        " if any(m == h or m.startswith(h + '.') for h in heavy))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        cwd=ROOT,
    )
    loaded: list[str] = json.loads(result.stdout.strip().splitlines()[-1])
    return loaded


def test_the_client_the_bridges_and_the_protocol_import_without_the_model() -> None:
    assert loaded_after("import engine.remote, engine.reconnect, engine.bridges, protocol") == []


def test_the_writer_imports_without_the_model() -> None:
    """`send`'s module and its wrapper `examples/replay_client.py`: a writer, not an engine."""
    statement = "import sys; sys.path.insert(0, 'examples'); import engine.cli.send, replay_client"
    assert loaded_after(statement) == []


def test_import_engine_alone_loads_no_model() -> None:
    assert loaded_after("import engine") == []


def test_a_public_name_loads_its_layer_on_first_use() -> None:
    loaded = loaded_after("import engine\nengine.Translator")
    assert "onnxruntime" in loaded and "engine.decoding.translator" in loaded


def test_the_public_names_resolve_and_nothing_else_does() -> None:
    import engine

    for name in engine.__all__:
        value = getattr(engine, name)
        assert value.__name__ == name and value.__module__.startswith("engine.")
    assert set(engine.__all__) <= set(dir(engine))
    with pytest.raises(AttributeError, match="has no attribute 'DecoderLayout'"):
        _ = engine.DecoderLayout  # reachable from its module, not from the public face
