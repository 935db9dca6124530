"""Starting the processes of a run: this process, PyTorch's launcher, or torchrun's.

- Under torchrun (or any launcher that sets torch.distributed's environment), each
  process reads its rank from the environment: one node or many work the same.
- Outside it, ``--pp 1`` and ``--single-process`` train in this process, and ``--pp P``
  starts P local processes through PyTorch's elastic launcher (what torchrun itself uses),
  each running ``python -m pipetrain.launch.worker ENTRY <run dir>/config.toml``; on a
  CPU they preload ``run.allocator``'s C allocator (``rank_preload``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from pipetrain.config.errors import ConfigError
from pipetrain.heap import allocator_library, preloading
from pipetrain.launch.process_exit import EXIT_RECORDS_ENV, exit_record

if TYPE_CHECKING:  # torch is imported when a launch starts, not with the CLI
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from pipetrain.config.schema import TrainConfig

__all__ = ["LaunchFailed", "launch_local", "rank_preload"]

_POLL_S = 0.5


class LaunchFailed(RuntimeError):
    """A started process exited with an error (printed above by that process)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _signals(exc: BaseException) -> int:
    """How many stop signals the launcher got: each one raised inside the handling of the
    one before, so they are chained as each other's context."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    count = 0
    link: BaseException | None = exc
    while link is not None:
        count += isinstance(link, SignalException)
        link = link.__context__
    return count


def _unfinished(config_path: Path, processes: int, *, waited: bool = True) -> str:
    """What went wrong with the ranks of a stopped launch, or "" when every one exited 0.

    ``waited``: the launcher saw every rank end (or killed it) before it returned."""
    problems = []
    for rank in range(processes):
        try:
            status = exit_record(config_path, rank).read_text().strip()
        except OSError:
            problems.append(
                f"rank {rank} was killed before it finished"
                if waited
                else f"rank {rank} had not finished (it may still be finishing its step and "
                f"saving, with output after this line)"
            )
            continue
        if status != "0":
            problems.append(f"rank {rank} exited with status {status}")
    return "; ".join(problems)


def _doctor_blame(config_path: Path, since: float) -> str | None:
    """The hang doctor's verdict on who stopped answering first, from the report that a
    failing rank wrote into the run folder after ``since`` (None without one)."""
    from pipetrain.diagnose.doctor import blame
    from pipetrain.runtime.hang import REPORT_FILE

    try:
        report = json.loads((config_path.parent / REPORT_FILE).read_text())
        fresh = report.get("by") == "failure" and float(report["collected_at"]) >= since
        found = blame(report) if fresh else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # no report, or not one this launcher can read: its own words stand
    return None if found is None else found.text


def _children() -> list[int]:
    """This process's children: the ranks torch's launcher started (Linux lists them in
    /proc; elsewhere none are found)."""
    found = []
    for children in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        with contextlib.suppress(OSError, ValueError):
            found += [int(pid) for pid in children.read_text().split()]
    return found


def _to_ranks(signum: int, frame: FrameType | None) -> None:
    """Pass a signal on to the ranks."""
    for pid in _children():
        with contextlib.suppress(OSError):
            os.kill(pid, signum)


def _continue_stopped_ranks(records: Path, done: threading.Event) -> None:
    """Once a rank has failed, continue the ranks that are stopped (SIGSTOP, a terminal's
    Ctrl-Z). torch's launcher then stops every rank with SIGTERM, which a stopped process
    does not act on until continued, and waits 30 s before it SIGKILLs it; continued, it
    takes the SIGTERM (or finds its peers gone) and ends in seconds, with its own line."""
    while not done.wait(_POLL_S):
        with contextlib.suppress(OSError):
            failed = any(r.read_text().strip() not in ("", "0") for r in records.glob("rank*"))
            if not failed:
                continue
        for pid in _children():
            with contextlib.suppress(OSError, IndexError):
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                if state == "T":
                    os.kill(pid, signal.SIGCONT)


def rank_preload(config: TrainConfig) -> str:
    """The shared library the ranks started here preload for their C heap ("" = none):
    ``run.allocator``'s on a CPU run; none on CUDA (the tensors are the GPU allocator's)
    or where the run maps its tensors through glibc (``run.map_tensors``)."""
    r, device = config.run, config.pipeline.device
    if r.map_tensors or device == "cuda":
        return ""
    if device == "auto":
        import torch

        if torch.cuda.is_available():
            return ""
    try:
        return allocator_library(r.allocator)
    except LookupError as exc:
        raise ConfigError(
            f"run.allocator is {r.allocator!r}, but {exc}: install it or --set run.allocator=auto"
        ) from None


def launch_local(config_path: Path, processes: int, *, entry: str, preload: str = "") -> None:
    """Run the worker in ``processes`` local processes; raise ``LaunchFailed`` if one fails.

    ``entry`` ("module:function") is the function each worker trains with (``worker``);
    ``preload``: a shared library the workers load first (``rank_preload``).

    A stop signal that every rank obeys (finished its step, saved, exited 0) lets the
    launcher's ``SignalException`` through; a stop that some rank did not survive is a
    ``LaunchFailed`` that names it.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
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
    started = time.time()
    records = exit_record(config_path, 0).parent
    shutil.rmtree(records, ignore_errors=True)  # an earlier run's
    # The ranks inherit the launcher's environment: where to leave their exit records.
    before = os.environ.get(EXIT_RECORDS_ENV)
    os.environ[EXIT_RECORDS_ENV] = str(records)
    # SIGUSR1 to the launcher asks every rank's hang doctor for a report.
    forwarding = signal.signal(signal.SIGUSR1, _to_ranks)
    done = threading.Event()
    threading.Thread(
        target=_continue_stopped_ranks, args=(records, done), name="pipetrain-continue", daemon=True
    ).start()
    try:
        with preloading(preload):
            elastic_launch(launch, sys.executable)(
                "-m", "pipetrain.launch.worker", entry, str(config_path)
            )
    except SignalException as exc:
        # torch's launcher waits for the ranks again after a second signal (up to 30 s
        # more, then SIGKILL), but a third one ends that wait: the ranks, which take a
        # repeated signal as the stop they are already doing, run on with no record yet.
        # They were said to be killed while they went on to save.
        problems = _unfinished(config_path, processes, waited=_signals(exc) < 3)
        if problems:
            raise LaunchFailed(
                f"stopped by signal {exc.sigval.name}, but not cleanly: {problems} "
                f"(the last checkpoint may be older than the last step)",
                1,
            ) from None
        raise
    except ChildFailedError as exc:
        raise _child_failed(exc, config_path, processes, started) from None
    finally:
        done.set()
        signal.signal(signal.SIGUSR1, forwarding)
        if before is None:
            os.environ.pop(EXIT_RECORDS_ENV, None)
        else:
            os.environ[EXIT_RECORDS_ENV] = before


def _child_failed(
    exc: ChildFailedError, config_path: Path, processes: int, started: float
) -> LaunchFailed:
    """One line for torch's ``ChildFailedError``: the rank that failed first, and why."""
    # Timestamps are whole seconds of when the launcher noticed: a rank that died and
    # the peers that then failed on its loss (status 1) often share one. Among those,
    # the one killed by a signal or refusing its input (status 2) is the cause.
    failures = sorted(
        exc.failures.items(), key=lambda item: (item[1].timestamp, item[1].exitcode == 1)
    )
    rank, failure = failures[0]
    # Exit status 2 is a bad input; any other one is a failure of the run.
    code = 2 if failure.exitcode == 2 else 1
    first = (
        f"rank {rank} was killed by {failure.signal_name()} first (exit status {failure.exitcode})"
        if failure.exitcode < 0
        else f"rank {rank} exited with status {failure.exitcode} first (its error is above)"
    )
    # Status 1 first: a rank that failed on a peer, maybe on one that stopped answering
    # and so exited last (killed by the launcher): the hang doctor knows which.
    culprit = _doctor_blame(config_path, started) if failure.exitcode == 1 else None
    if culprit is not None:
        first = f"{culprit} (`pipetrain doctor {config_path.parent}` shows its report)"
    return LaunchFailed(f"{first}; {len(failures)} of {processes} processes failed", code)
