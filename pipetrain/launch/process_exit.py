"""How a rank's process ends (torch-free, so that the CLI can use it before importing torch).

Every process of a launched run (the local launcher's workers, torchrun's ranks of any
subcommand) ends through ``exit_rank``; ``launched_rank`` tells such a process apart.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

__all__ = [
    "EXIT_RECORDS_ENV",
    "LAUNCH_ENV",
    "exit_rank",
    "exit_record",
    "launched_rank",
    "record_exit",
]

# Set by torchrun and the elastic agent in every process it starts.
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# Set by the local launcher for its ranks: the folder of their exit records.
EXIT_RECORDS_ENV = "PIPETRAIN_EXIT_RECORDS"


def launched_rank(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process was started as a rank by torchrun (or PyTorch's launcher)."""
    env = os.environ if environ is None else environ
    return all(key in env for key in LAUNCH_ENV)


def exit_record(config_path: Path, rank: int) -> Path:
    """Where the local launcher's worker of ``rank`` leaves its exit status.

    After a stop signal torch's launcher raises ``SignalException`` and keeps the ranks'
    exit statuses to itself (it also SIGKILLs a rank still running 30 s later): these
    files tell a stop that every rank finished from one that some rank did not.
    """
    return config_path.parent / ".exit" / f"rank{rank}"


def record_exit(code: int) -> None:
    """Leave this rank's exit status where its local launcher looks (``exit_record``);
    nothing outside the local launcher's ranks."""
    folder = os.environ.get(EXIT_RECORDS_ENV)
    if not folder or not launched_rank():
        return
    # Unwritable: the launcher then counts this rank as killed, which errs on the safe side.
    with contextlib.suppress(OSError):
        path = Path(folder) / f"rank{os.environ['RANK']}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{code}\n")


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
