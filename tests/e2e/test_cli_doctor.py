"""`kill -USR1` to `pipetrain train --pp 2`'s launcher: the ranks' hang doctor reports on
the live run (the run goes on), and `pipetrain doctor RUN_DIR` prints the report again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

FLAGS = [
    "--model", "llama-tiny", "--pp", "2", "--steps", "100000", "--batch-size", "4",
    "--seq-len", "16", "--microbatches", "2", "--set", "optim.warmup_steps=0",
    "--set", "run.evaluate=false", "--set", "pipeline.threads=1",
]  # fmt: skip


def _wait_for(path: Path, text: str, proc: subprocess.Popen[bytes], limit_s: float) -> str:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None:
        content = path.read_text(errors="replace") if path.exists() else ""
        if text in content:
            return content
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {path.name}: {path.read_text()[-3000:]}")


def test_sigusr1_to_the_launcher_reports_the_live_run(work: Path, tmp_path: Path) -> None:
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipetrain.cli", "train", *FLAGS, "--data", "data",
             "--name", "usr1"],
            cwd=work,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        try:
            # Printed after every rank built its pipeline (and its doctor's watch).
            _wait_for(out, "early input gradients", proc, 180)
            time.sleep(1.0)
            proc.send_signal(signal.SIGUSR1)
            text = _wait_for(err, "[doctor] verdict:", proc, 60)
            assert proc.poll() is None, text[-3000:]  # the run goes on
            assert "[doctor] hang doctor, report 1: SIGUSR1 to rank " in text, text[-3000:]
            report = json.loads((work / "runs" / "usr1" / "doctor.json").read_text())
            assert sorted(report["ranks"]) == ["0", "1"], report
            assert all(state is not None for state in report["ranks"].values()), report
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    shown = subprocess.run(
        [sys.executable, "-m", "pipetrain.cli", "doctor", "runs/usr1"],
        cwd=work,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert shown.startswith("hang doctor, report 1: SIGUSR1 to rank "), shown
    assert "verdict: " in shown, shown
    missing = subprocess.run(
        [sys.executable, "-m", "pipetrain.cli", "doctor", "data"],
        cwd=work,
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 1 and "no hang doctor report in data" in missing.stdout
