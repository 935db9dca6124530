"""`pipetrain train --pp 2` with a step that does not end: its ranks never outlive a
launcher killed with SIGKILL, and SIGTERM ends the step after run.stop_grace_s instead of
waiting for it.

A ``sitecustomize`` module (imported at start-up by every process) makes rank 1's third
``Pipeline.step`` a ten-minute op: SIGTERM blocked in the main thread and a sleep, so
Python runs no signal handler there until it returns, as with one long op in C.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

FLAGS = [
    "--model", "llama-tiny", "--pp", "2", "--steps", "100", "--batch-size", "4",
    "--seq-len", "16", "--microbatches", "2", "--set", "optim.warmup_steps=0",
    "--set", "run.evaluate=false", "--set", "run.sample_tokens=0",
    "--set", "pipeline.threads=1", "--data", "data",
]  # fmt: skip

LONG_STEP_ON_RANK_1 = textwrap.dedent(
    """
    import os
    if os.environ.get("RANK") == "1":
        import signal
        import time
        from pathlib import Path
        from pipetrain.runtime.api import Pipeline

        step = Pipeline.step
        calls = []

        def long_step(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
                Path(os.environ["FAULT_AT"]).write_text(str(os.getpid()))
                time.sleep(600)
            return step(self, *args, **kwargs)

        Pipeline.step = long_step
    """
)


def _descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        children = [p for p, parent in parents.items() if parent == current]
        found += children
        frontier += children
    return found


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start(work: Path, tmp_path: Path, *flags: str) -> tuple[subprocess.Popen[str], Path]:
    (tmp_path / "sitecustomize.py").write_text(LONG_STEP_ON_RANK_1)
    fault = tmp_path / "fault_at"
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "FAULT_AT": str(fault)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipetrain.cli", "train", *FLAGS, *flags],
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env,
    )
    deadline = time.monotonic() + 180
    while not fault.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(1.0)  # rank 0 now waits on rank 1, rank 1 is in its long op
    return proc, fault


def test_no_rank_outlives_a_launcher_killed_in_a_long_step(work: Path, tmp_path: Path) -> None:
    proc, _ = _start(work, tmp_path, "--name", "orphans")
    ranks = _descendants(proc.pid)
    try:
        assert len(ranks) >= 2, ranks
        proc.kill()
        proc.communicate()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_running(pid) for pid in ranks):
            time.sleep(0.2)
        assert not [pid for pid in ranks if _running(pid)]
    finally:
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_sigterm_gives_up_a_step_that_outlasts_the_grace(work: Path, tmp_path: Path) -> None:
    flags = ["--name", "grace", "--checkpoint-dir", "ck", "--checkpoint-every", "1"]
    proc, _ = _start(work, tmp_path, *flags, "--set", "run.stop_grace_s=3")
    sent = time.monotonic()
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # as a scheduler stops a job: every process
        _, err = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    took = time.monotonic() - sent
    # Within the grace and a few seconds, not the launcher's own 30 s before SIGKILL.
    assert took < 20, (took, err[-3000:])
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    abandoned = (
        "pipetrain train (rank 1): SIGTERM came 3 s ago, during a training step that has "
        "not ended: stopped without finishing or saving it"
    )
    assert abandoned in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("pipetrain train: stopped by signal SIGTERM, but not cleanly: "), last
    assert "rank 1 exited with status 143" in last, last
    # The steps before the long one were saved and stay whole.
    saved = sorted(p.name for p in (work / "ck").iterdir() if not p.name.startswith("."))
    assert saved == ["step_000001", "step_000002"], saved
    lines = (work / "runs" / "grace" / "metrics.jsonl").read_text().splitlines()
    assert all(json.loads(line) for line in lines)
