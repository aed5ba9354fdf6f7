"""Build the speed-benchmark model: real OPUS-MT zh->en architecture, random weights.

No trained weights can be had on these machines, but decode cost per token depends only on
the architecture and vocabulary size, so a randomly initialised ``MarianMTModel`` built from
the real ``config.json`` costs exactly what the real model costs. This script makes, in a
cache directory that is never committed:

- ``checkpoint/``: the PyTorch checkpoint plus the real tokenizer files;
- ``onnx/``: the Optimum ONNX export (merged and split decoders) and its int8 variants,
  made with the project's own ``engine.conversion`` so the benchmark measures what ships;
- ``ct2-float32/`` and ``ct2-int8/``: the same checkpoint converted by CTranslate2's own
  converter, the reference the engine's speed is compared against.

Every step is skipped when its output already exists, unless ``--force`` is given.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from engine.model.config import TOKENIZER_FILES

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG_DIR = REPO_ROOT.parent / "shared" / "opus-mt-zh-en"
DEFAULT_OUT = REPO_ROOT / ".cache" / "benchmark-model"
# Copied from the real model's directory: the tokenizer and its settings. Not config.json
# (save_pretrained writes it) nor generation_config.json: the benchmark model keeps the
# generation settings transformers derives from the config.
SIDE_FILES = (*(n for n in TOKENIZER_FILES if n != "config.json"), "tokenizer_config.json")
CT2_QUANTIZATIONS = ("float32", "int8")
ONNX_STEMS = ("encoder_model", "decoder_model", "decoder_with_past_model", "decoder_model_merged")


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _mib(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:8.1f} MiB"


def _reset(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)


def build_checkpoint(config_dir: Path, out: Path, seed: int, force: bool) -> Path:
    """Save a seeded random-weight MarianMTModel plus the real tokenizer files."""
    ckpt = out / "checkpoint"
    if (ckpt / "config.json").exists() and (ckpt / "model.safetensors").exists() and not force:
        print(f"checkpoint: exists, skipped ({ckpt})")
        return ckpt
    import torch
    from transformers import MarianConfig, MarianMTModel

    _reset(ckpt)
    torch.manual_seed(seed)
    config = MarianConfig.from_pretrained(str(config_dir))
    model = MarianMTModel(config)
    model.save_pretrained(str(ckpt))
    for name in SIDE_FILES:
        shutil.copy2(config_dir / name, ckpt / name)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"checkpoint: {n_params / 1e6:.1f} M parameters, seed {seed} -> {ckpt}")
    return ckpt


def build_onnx(ckpt: Path, out: Path, force: bool, requantize: bool = False) -> Path:
    """Export with the engine's exporter and quantize with the engine's quantizer."""
    from engine.conversion.export import export_marian
    from engine.conversion.quantize import quantize_int8

    onnx_dir = out / "onnx"
    if all((onnx_dir / f"{stem}.onnx").exists() for stem in ONNX_STEMS) and not force:
        print(f"onnx export: exists, skipped ({onnx_dir})")
    else:
        _reset(onnx_dir)
        export_marian(ckpt, onnx_dir)
        print(f"onnx export: -> {onnx_dir}")
    quantized = [onnx_dir / f"{stem}_quantized.onnx" for stem in ONNX_STEMS]
    if all(p.exists() for p in quantized) and not (force or requantize):
        print("onnx int8: exists, skipped")
    else:
        for path in quantized:  # a failed run may leave some behind; never mix two runs
            path.unlink(missing_ok=True)
        quantize_int8(onnx_dir)
        print("onnx int8: done")
    return onnx_dir


def build_ct2(ckpt: Path, out: Path, force: bool) -> list[Path]:
    """Convert the same checkpoint with CTranslate2's converter (fp32 and int8)."""
    import ctranslate2

    made = []
    for quantization in CT2_QUANTIZATIONS:
        target = out / f"ct2-{quantization}"
        made.append(target)
        if (target / "model.bin").exists() and not force:
            print(f"ct2 {quantization}: exists, skipped ({target})")
            continue
        converter = ctranslate2.converters.TransformersConverter(str(ckpt))
        converter.convert(str(target), quantization=quantization, force=True)
        print(f"ct2 {quantization}: -> {target}")
    return made


def print_summary(out: Path) -> None:
    print(f"\nbenchmark model in {out}:")
    for sub in sorted(p for p in out.iterdir() if p.is_dir()):
        print(f"  {sub.name + '/':<16}{_mib(_dir_size(sub))}")
        for f in sorted(sub.iterdir()):
            if f.is_file() and f.suffix in {".onnx", ".bin", ".safetensors"}:
                print(f"    {f.name:<40}{_mib(f.stat().st_size)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config-dir",
        type=Path,
        default=DEFAULT_CONFIG_DIR,
        help="real OPUS-MT zh->en config + tokenizer (default: %(default)s)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="cache directory, not committed (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight init seed")
    parser.add_argument("--force", action="store_true", help="rebuild every step")
    parser.add_argument(
        "--requantize",
        action="store_true",
        help="redo only the int8 step (after engine.conversion.quantize changed)",
    )
    parser.add_argument("--skip-ct2", action="store_true", help="do not build CTranslate2 models")
    args = parser.parse_args(argv)

    config_dir: Path = args.config_dir
    wanted = dict.fromkeys((*TOKENIZER_FILES, *SIDE_FILES))
    missing = [n for n in wanted if not (config_dir / n).is_file()]
    if missing:
        print(
            f"error: {config_dir} lacks {', '.join(missing)}; the benchmark model needs the "
            "real OPUS-MT zh->en config and tokenizer (../shared/opus-mt-zh-en, or "
            "--config-dir)",
            file=sys.stderr,
        )
        return 2
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))

    ckpt = build_checkpoint(config_dir, out, args.seed, args.force)
    build_onnx(ckpt, out, args.force, args.requantize)
    if not args.skip_ct2:
        build_ct2(ckpt, out, args.force)
    print_summary(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
