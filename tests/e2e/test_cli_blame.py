"""`pipetrain train --pp 3` with rank 0 stopped (SIGSTOP) at the start of its third step:
ranks 1 and 2 time out and exit, and the launcher's last line names rank 0, the rank
that stopped answering first, as the hang doctor's report in the run folder does; not
rank 1, the first to exit (what it said before).

Once the other two have exited, the launcher continues rank 0 (SIGCONT), which then takes
torch's launcher's SIGTERM or fails on its lost peers, last: the run ends within seconds,
not after the 30 s that torch's launcher waits before it SIGKILLs a rank.
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

from pipetrain.diagnose.doctor import blame

pytestmark = pytest.mark.e2e

FLAGS = [
    "--model", "llama-tiny", "--pp", "3", "--steps", "100", "--batch-size", "6",
    "--seq-len", "16", "--microbatches", "3", "--set", "optim.warmup_steps=0",
    "--set", "run.evaluate=false", "--set", "run.sample_tokens=0",
    "--set", "pipeline.threads=1", "--set", "pipeline.timeout_s=10", "--data", "data",
    "--name", "blame",
]  # fmt: skip

STOP_RANK_0 = textwrap.dedent(
    """
    import os
    if os.environ.get("RANK") == "0":
        import signal
        from pipetrain.runtime.api import Pipeline

        step = Pipeline.step
        calls = []

        def stopping_step(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                os.kill(os.getpid(), signal.SIGSTOP)
            return step(self, *args, **kwargs)

        Pipeline.step = stopping_step
    """
)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _ranks(launcher: int) -> dict[int, int]:
    """Rank -> process id of the launcher's children."""
    found = {}
    for pid in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
        with contextlib.suppress(OSError):
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            env = dict(item.decode().split("=", 1) for item in environ if b"=" in item)
            if "RANK" in env:  # not a child caught between its fork and exec
                found[int(env["RANK"])] = int(pid)
    return found


def test_the_launcher_blames_the_rank_that_stopped_answering(work: Path, tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(STOP_RANK_0)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipetrain.cli", "train", *FLAGS],
        cwd=work,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    try:
        deadline = time.monotonic() + 180
        ranks: dict[int, int] = {}
        while not (0 in ranks and _state(ranks[0]) == "T"):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
            ranks = _ranks(proc.pid)
        while any(_state(ranks[r]) not in ("Z", "gone") for r in (1, 2)):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        _, err = proc.communicate(timeout=20)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(
        "pipetrain train: rank 0 stopped answering first (the hang doctor heard nothing from "
        "it for "
    ), last
    assert last.endswith(
        "(`pipetrain doctor runs/blame` shows its report); 3 of 3 processes failed"
    ), last
    report = json.loads((work / "runs" / "blame" / "doctor.json").read_text())
    found = blame(report)
    assert found is not None and found.rank == 0, report
