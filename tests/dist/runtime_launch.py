"""Start N runtime_worker.py processes on a free local port, like torchrun but cheaper.

Each process gets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and one thread; the caller
gets their exit codes, stderr, the wall time and when each process exited.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from local_port import reserved_port

WORKER = Path(__file__).with_name("runtime_worker.py")


@dataclass(frozen=True)
class Launch:
    returncodes: tuple[int, ...]
    stderr: tuple[str, ...]
    seconds: float
    # time.time() at which each process was seen to exit (polled every 50 ms).
    exited_at: tuple[float, ...] = ()


def launch(world: int, args: list[str], timeout_s: float = 240.0, worker: Path = WORKER) -> Launch:
    with contextlib.ExitStack() as stack:
        port = stack.enter_context(reserved_port())
        # stderr to files, not pipes: a full pipe would block a worker while we poll.
        logs = [stack.enter_context(tempfile.TemporaryFile(mode="w+")) for _ in range(world)]
        procs = []
        start = time.monotonic()
        for rank in range(world):
            env = dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(worker), *args],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=logs[rank],
                    text=True,
                )
            )
        exited: dict[int, float] = {}
        try:
            while len(exited) < world and time.monotonic() - start < timeout_s:
                for rank, proc in enumerate(procs):
                    if rank not in exited and proc.poll() is not None:
                        exited[rank] = time.time()
                time.sleep(0.05)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        errs = []
        for log in logs:
            log.seek(0)
            errs.append(log.read())
    return Launch(
        tuple(p.returncode for p in procs),
        tuple(errs),
        time.monotonic() - start,
        tuple(exited.get(r, float("inf")) for r in range(world)),
    )


def torchrun(
    script: Path, nproc: int, args: list[str], env: dict[str, str] | None = None
) -> tuple[int, str]:
    """``torchrun --nproc-per-node nproc script *args`` on a held local port: its exit
    status and stderr. A session of its own, so a timeout takes the workers down with it."""
    with reserved_port() as port:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
        command += ["--master-addr", "127.0.0.1", "--master-port", str(port), str(script), *args]
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=env,
        )
        try:
            _, stderr = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    return proc.returncode, stderr
