"""Starting the processes of a run: this process, PyTorch's launcher, or torchrun's.

- Under torchrun (or any launcher that sets torch.distributed's environment), each
  process reads its rank from the environment: one node or many work the same.
- Outside it, ``--pp 1`` and ``--single-process`` train in this process, and ``--pp P``
  starts P local processes through PyTorch's elastic launcher (what torchrun itself uses),
  each running ``python -m pipetrain.train.worker <run dir>/config.toml``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

from pipetrain.train.loop import ProcessRole

__all__ = ["LaunchFailed", "exit_rank", "launch_local", "role_from_env"]

# Set by torchrun and the elastic agent in every process it starts.
_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


class LaunchFailed(RuntimeError):
    """A started process exited with an error (printed above by that process)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def role_from_env(environ: Mapping[str, str] | None = None) -> ProcessRole | None:
    """This process's place in a torchrun-style launch, or None when not launched so."""
    env = os.environ if environ is None else environ
    if not all(key in env for key in _ENV_KEYS):
        return None
    world = int(env["WORLD_SIZE"])
    return ProcessRole(
        rank=int(env["RANK"]),
        world_size=world,
        local_rank=int(env["LOCAL_RANK"]),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
    )


def exit_rank(code: int) -> NoReturn:
    """End a rank's process with ``code`` at once, without the interpreter's finalization.

    gloo runs collectives on its own C++ threads, and such a thread drops its reference
    to a finished collective's tensors a moment after the collective has returned. Once
    Python has let go of those tensors, that drop takes the GIL. A thread that waits for
    the GIL when the interpreter starts to finalize is ended by Python (before 3.14)
    with ``pthread_exit``, whose unwinding meets a noexcept destructor of gloo's work:
    std::terminate, SIGABRT, "terminate called without an active exception", after a run
    that succeeded (torch issue 38228; tests/dist/test_rank_exit.py reproduces it).
    ``destroy_process_group`` does not join those threads, and nothing can tell from
    Python when they are done. Without finalization there is nothing for them to meet:
    ``_exit`` ends every thread where it stands. A run has closed its files by then (and
    writes its metrics lines flushed, failed or not); stdout and stderr are flushed here.
    """
    for stream in (sys.stdout, sys.stderr):
        # A closed or broken stream: nothing more can reach its reader.
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def launch_local(config_path: Path, processes: int) -> None:
    """Run the worker in ``processes`` local processes; raise ``LaunchFailed`` if one fails."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    launch = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=processes,
        run_id=uuid.uuid4().hex,
        # A rendezvous on a free port of this machine, as `torchrun --standalone` does.
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        # A failed run is not retried: the error would only come back.
        max_restarts=0,
        monitor_interval=0.1,
    )
    try:
        elastic_launch(launch, sys.executable)("-m", "pipetrain.train.worker", str(config_path))
    except ChildFailedError as exc:
        failures = sorted(exc.failures.items(), key=lambda item: item[1].timestamp)
        rank, failure = failures[0]
        # Exit status 2 is a bad input; any other one is a failure of the run.
        code = 2 if failure.exitcode == 2 else 1
        raise LaunchFailed(
            f"rank {rank} exited with status {failure.exitcode} first (its error is above); "
            f"{len(failures)} of {processes} processes failed",
            code,
        ) from None
