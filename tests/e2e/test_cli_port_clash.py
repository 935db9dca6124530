"""A second run started on the port of a first run's store: every process of the second
run stops with one line that names the port and the fix (exit status 2), and the first
run trains on untouched.

The first run is either started by hand (each rank with RANK, WORLD_SIZE and MASTER_PORT,
rank 0 hosting the store) or by `pipetrain train --pp 2` (the local launcher hosts it);
the second run is started by hand on the same port.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from local_port import reserved_port

pytestmark = pytest.mark.e2e

FLAGS = [
    "--model", "llama-tiny", "--pp", "2", "--steps", "100000", "--batch-size", "4",
    "--seq-len", "16", "--microbatches", "2", "--set", "optim.warmup_steps=0",
    "--set", "run.evaluate=false", "--set", "run.sample_tokens=0",
    "--set", "pipeline.threads=1", "--data", "data",
]  # fmt: skip
FIX = "start this run on another port (torchrun --master-port, or MASTER_PORT)"


def _by_hand(work: Path, port: int, name: str, logs: Path) -> list[subprocess.Popen[str]]:
    """Two ranks started by hand on ``port``, each with its own stderr log."""
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "pipetrain.cli", "train", *FLAGS, "--name", name],
                cwd=work,
                stdout=subprocess.DEVNULL,
                stderr=(logs / f"{name}{rank}.err").open("w"),
                text=True,
                start_new_session=True,
                env=env,
            )
        )
    return procs


def _training(work: Path, name: str, procs: list[subprocess.Popen[str]]) -> None:
    metrics = work / "runs" / name / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and '"loss"' in metrics.read_text()):
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
        time.sleep(0.2)


@contextlib.contextmanager
def _ended(procs: list[subprocess.Popen[str]]) -> Iterator[None]:
    try:
        yield
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _second_run_refused(work: Path, port: int, logs: Path) -> tuple[str, str]:
    """Start the second run on ``port``: both processes exit 2; their last lines."""
    second = _by_hand(work, port, "second", logs)
    with _ended(second):
        for proc in second:
            assert proc.wait(timeout=120) == 2
    lines = [(logs / f"second{rank}.err").read_text().strip().splitlines() for rank in (0, 1)]
    assert not any("Traceback" in line for rank in lines for line in rank), lines
    return lines[0][-1], lines[1][-1]


def _still_training(work: Path, name: str, procs: list[subprocess.Popen[str]]) -> None:
    metrics = work / "runs" / name / "metrics.jsonl"
    before = len(metrics.read_text().splitlines())
    time.sleep(2.0)
    assert all(p.poll() is None for p in procs)
    lines = metrics.read_text().splitlines()
    assert len(lines) > before and all(json.loads(line) for line in lines[:-1])


def test_a_run_started_by_hand_on_a_taken_port(work: Path, tmp_path: Path) -> None:
    with reserved_port() as port:
        first = _by_hand(work, port, "first", tmp_path)
        with _ended(first):
            _training(work, "first", first)
            rank0, rank1 = _second_run_refused(work, port, tmp_path)
            _still_training(work, "first", first)
    assert rank0 == (
        f"pipetrain train: error: rank 0: port 127.0.0.1:{port} is already in use (by another "
        f"run's store, or another program): {FIX}"
    )
    assert rank1.startswith(
        f"pipetrain train: error: rank 1: the store at 127.0.0.1:{port} belongs to another "
        f"run (process {first[1].pid} on "
    ), rank1
    assert rank1.endswith(f" joined it as rank 1): {FIX}"), rank1


def test_a_run_started_by_hand_on_the_local_launchers_port(work: Path, tmp_path: Path) -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-m", "pipetrain.cli", "train", *FLAGS, "--name", "local"],
        cwd=work,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    with _ended([launcher]):
        _training(work, "local", [launcher])
        children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text()
        environ = Path(f"/proc/{children.split()[0]}/environ").read_bytes().split(b"\0")
        env = dict(item.decode().split("=", 1) for item in environ if b"=" in item)
        port = int(env["MASTER_PORT"])  # the launcher's store, which its ranks joined
        rank0, rank1 = _second_run_refused(work, port, tmp_path)
        _still_training(work, "local", [launcher])
    assert rank0.startswith(f"pipetrain train: error: rank 0: port 127.0.0.1:{port} is already")
    assert rank1 == (
        f"pipetrain train: error: rank 1: the store at 127.0.0.1:{port} belongs to another run "
        f"(run id {env['TORCHELASTIC_RUN_ID']}; this one's is none): {FIX}"
    )
