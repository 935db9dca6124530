"""Start N runtime_worker.py processes on a free local port, like torchrun but cheaper.

Each process gets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and one thread; the caller
gets their exit codes, output and the wall time.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

WORKER = Path(__file__).with_name("runtime_worker.py")


@dataclass(frozen=True)
class Launch:
    returncodes: tuple[int, ...]
    stderr: tuple[str, ...]
    seconds: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(world: int, args: list[str], timeout_s: float = 240.0, worker: Path = WORKER) -> Launch:
    port = free_port()
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
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    errs = []
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=max(1.0, timeout_s - (time.monotonic() - start)))
            errs.append(err)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return Launch(tuple(p.returncode for p in procs), tuple(errs), time.monotonic() - start)
