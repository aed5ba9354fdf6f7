"""Commit policies side by side on both fixtures and their recogniser-style logs.

For each fixture (the prefix-trained one and the offline-trained one, which invents endings
for partial sources as real OPUS-MT models do) and its recogniser-style log (shown words
rewritten, lowercase, no punctuation: `logs make --realistic`), replays the log with each
policy and prints one Markdown table: finals that revise stable text, normalized erasure,
LAAL on displayed and on stable text (source units), and segments with stable text before
their final. Replays are not real time: the figures are the same on any machine.

    python examples/benchmarks/policy_table.py [--json OUT.json] [--more-logs]

`--more-logs` then checks the offline-trained fixture's figures on three more
recogniser-style logs made here (`logs make --realistic`, other seeds, and the held-out
sentences 41-80 as well as 1-40), so that a policy is not judged on one log of 40 segments.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
LOGS = REPO_ROOT / "examples" / "logs"
FIXTURES = {
    "prefix-trained": (REPO_ROOT / "models" / "fixture" / "model", LOGS / "fixture_en_zh_asr"),
    "offline-trained": (
        REPO_ROOT / "models" / "fixture_offline" / "model",
        LOGS / "fixture_offline_en_zh_asr",
    ),
}
POLICIES: dict[str, list[str]] = {
    "LA-2": ["--policy", "la:2"],
    "first-word": ["--policy", "first-word"],
    "LA-3": ["--policy", "la:3"],
    "LA-4": ["--policy", "la:4"],
    "mask-3": ["--policy", "mask:3"],
    "biased 0.3": ["--policy", "biased:0.3"],
    "LA-2 + source agreement 2": ["--source-agreement", "2"],
    "LA-2 + settled source 2": ["--settled-source", "2"],
    "LA-2 + settled source 3": ["--settled-source", "3"],
    "LA-4 + settled source 2": ["--policy", "la:4", "--settled-source", "2"],
}
DEFAULTS = {"prefix-trained": "LA-2", "offline-trained": "first-word"}  # `default_policy`
CHECKED = ("LA-2", "first-word", "LA-4 + settled source 2")  # on --more-logs
MORE_LOGS = (("1-40", 12), ("41-80", 11), ("41-80", 13))  # held-out sentences, seed


def replay(model: Path, log: Path, extra: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "engine.cli",
                "replay",
                "--model",
                str(model),
                str(log.with_suffix(".jsonl")),
                "--references",
                str(log.with_suffix(".ref.txt")),
                "--no-progress",
                "--report",
                str(report),
                *extra,
            ],
            check=True,
            cwd=REPO_ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        data: dict[str, Any] = json.loads(report.read_text(encoding="utf-8"))
    return data


def make_logs(out: Path) -> list[Path]:
    """Recogniser-style logs of the offline fixture's held-out written sentences."""
    heldout = REPO_ROOT / "models" / "fixture_offline" / "heldout.tsv"
    rows = [line.split("\t") for line in heldout.read_text(encoding="utf-8").splitlines()]
    written = [r for r in rows if len(r) > 2 and r[2] == "written"]
    logs = []
    for span, seed in MORE_LOGS:
        first, last = map(int, span.split("-"))
        chosen = written[first - 1 : last]
        src, ref = out / f"{span}.src", out / f"{span}.ref"
        src.write_text("".join(r[0] + "\n" for r in chosen), encoding="utf-8")
        ref.write_text("".join(r[1].rstrip("。？") + "\n" for r in chosen), encoding="utf-8")
        log = out / f"heldout_{span}_seed{seed}"
        subprocess.run(
            [
                *(sys.executable, "-m", "engine.cli", "logs", "make", str(src), "--lang", "en"),
                *("--references", str(ref), "--realistic", "--seed", str(seed)),
                *("--out", str(log.with_suffix(".jsonl"))),
            ],
            check=True,
            cwd=REPO_ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        logs.append(log)
    return logs


def more_logs() -> None:
    model = FIXTURES["offline-trained"][0]
    print(
        "\n| log (offline-trained) | policy | revised finals | LAAL stable | stable before final |"
    )
    print("|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for log in make_logs(Path(tmp)):
            for policy in CHECKED:
                r = replay(model, log, POLICIES[policy])["report"]
                print(
                    f"| {log.name} | {policy} | {r['revised_finals']}/{r['segments']} | "
                    f"{r['laal_stable']:.2f} | {r['segments_with_early_stable']}/{r['segments']} |",
                    flush=True,
                )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--more-logs", action="store_true", help="see the module docstring")
    args = parser.parse_args(argv)
    rows = []
    print(
        "| fixture | policy | revised finals | normalized erasure | LAAL displayed | "
        "LAAL stable | stable before final | decoder calls / update |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for fixture, (model, log) in FIXTURES.items():
        if not model.is_dir() or not log.with_suffix(".jsonl").is_file():
            print(f"missing {model} or {log}.jsonl", file=sys.stderr)
            return 2
        for policy, extra in POLICIES.items():
            data = replay(model, log, extra)
            r, c = data["report"], data["counts"]
            calls = (c["decoder_steps"] + c["prefill_calls"]) / max(c["updates"], 1)
            label = f"{policy} (default)" if DEFAULTS[fixture] == policy else policy
            row = {
                "fixture": fixture,
                "policy": label,
                "segments": r["segments"],
                "revised_finals": r["revised_finals"],
                "normalized_erasure": r["normalized_erasure"],
                "laal": r["laal"],
                "laal_stable": r["laal_stable"],
                "early_stable": r["segments_with_early_stable"],
                "decoder_calls_per_update": calls,
            }
            rows.append(row)
            print(
                f"| {fixture} | {label} | {r['revised_finals']}/{r['segments']} | "
                f"{r['normalized_erasure']:.3f} | {r['laal']:.2f} | {r['laal_stable']:.2f} | "
                f"{r['segments_with_early_stable']}/{r['segments']} | {calls:.2f} |",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    if args.more_logs:
        more_logs()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
