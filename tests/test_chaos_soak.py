"""The chaos soak's short version: a real `serve` on loopback with churn, leakers, bursts
and a flood beside a normal writer and a viewer, then SIGTERM. Every final must be
answered, no stream left open, exit status 0, no traceback (the script checks and exits 1
otherwise). The long run is `examples/benchmarks/chaos_soak.py --seconds 60`."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import ROOT, needs_fixture


def test_short_chaos_soak_answers_every_final_and_leaks_nothing() -> None:
    needs_fixture()
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "benchmarks" / "chaos_soak.py"), "--seconds", "4"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    sent, answered = map(int, re.search(r"finals sent / answered: (\d+) / (\d+)", out).groups())  # type: ignore[union-attr]
    assert sent == answered > 0
    assert "streams left open after all clients left: 0" in out
    assert "server exit status after SIGTERM: 0; traceback logged: False" in out
