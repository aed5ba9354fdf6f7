"""`.ci/run` is never silent for long: its installs run under `quietly`
(`.ci/progress.sh`), which says every few seconds that the step is still running, keeps
the step's stdout aside, and shows it when the step fails."""

from __future__ import annotations

import subprocess

from tests.conftest import ROOT

PROGRESS = ROOT / ".ci" / "progress.sh"


def bash(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", f". {PROGRESS}\n{script}"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PROGRESS_EVERY": "1"},
        check=False,
    )


def test_a_long_step_says_it_is_still_running() -> None:
    done = bash("quietly bash -c 'echo pip chatter; sleep 2.5'; echo rc=$?")
    lines = done.stdout.splitlines()
    assert [line for line in lines if line.startswith("   ... still running (")][:2] == [
        "   ... still running (1 s)",
        "   ... still running (2 s)",
    ]
    assert lines[-1] == "rc=0" and "pip chatter" not in done.stdout + done.stderr


def test_a_failing_step_shows_what_it_said_and_fails() -> None:
    done = bash("quietly bash -c 'echo the reason; exit 3' || echo failed")
    assert "the reason" in done.stderr and done.stdout.strip().endswith("failed")


def test_the_run_script_installs_under_quietly_and_names_its_stages() -> None:
    run = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    installs = [line for line in run.splitlines() if "pip install" in line]
    assert installs and all(line.startswith("quietly ") for line in installs), installs
    assert ". .ci/progress.sh" in run and 'stage "pytest"' in run
