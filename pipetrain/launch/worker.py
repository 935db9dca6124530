"""One process of a launched run: ``python -m pipetrain.launch.worker MODULE:FUNCTION CONFIG.toml``.

Started by ``launch_local`` with torch.distributed's environment set. The launcher names
the function that trains (``pipetrain.train.loop:train``, called as ``function(config,
role, announced=True)``): this package starts processes and knows no trainer. Errors are
one line on stderr naming the rank; exit status 2 for bad input, 1 for a failed run. The
process ends through ``process_exit.exit_rank``, without the interpreter's finalization,
which gloo's threads can turn into a SIGABRT after a successful run (its docstring says
how).

A stop signal (SIGTERM, or the Ctrl-C that the launcher forwards) can come at any moment.
During the training steps the trainer's ``StopSignal`` makes it finish the step, save and
stop (after SIGTERM, a step that does not end within run.stop_grace_s is given up:
``guard.StopGrace``); the rank also stops when its launcher dies (``guard.watch_launcher``).
Outside them (importing torch, meeting the other ranks, building the model; the
final evaluation and sample) no step can be cut short, so the rank ends there in one line
with status 0, as a stop asked for is not a failure: torch's default handling printed a
KeyboardInterrupt traceback per rank (or died of SIGTERM), and the launcher called the stop
unclean. That handler is installed before anything heavy is imported, which is why this
module imports torch only inside ``main``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from pipetrain.config import PipelineConfig, load_config
from pipetrain.errors import InputError, RunFailed
from pipetrain.launch.guard import watch_launcher
from pipetrain.launch.process_exit import exit_rank, launched_rank, record_exit
from pipetrain.launch.role import ProcessRole, role_from_env

__all__ = ["main"]

_DOCTOR_STORE_S = 10.0  # how long a failed rank tries to reach the store for the doctor


def _rank() -> int:
    """This process's rank, from the launcher's environment (0 outside a launch)."""
    return int(os.environ["RANK"]) if launched_rank() else 0


def _stop_outside_training(signum: int, frame: FrameType | None) -> None:
    """SIGTERM/SIGINT while no training step runs: end the rank now, cleanly (module doc).

    The trainer's ``StopSignal`` replaces this handler for the training steps and puts it
    back after them. It writes with ``os.write`` and leaves with ``os._exit``: a handler
    runs between any two bytecodes, maybe inside a write to the same stream, where a
    buffered write would raise 'reentrant call'."""
    name = signal.Signals(signum).name
    line = (
        f"pipetrain train (rank {_rank()}): stopped by {name} outside the training steps "
        f"(starting up, or after the last one): no step was cut short\n"
    )
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a reentrant flush raises RuntimeError
            stream.flush()
    with contextlib.suppress(OSError):
        os.write(sys.stderr.fileno(), line.encode())
    record_exit(0)
    os._exit(0)


def main(argv: Sequence[str] | None = None) -> int:
    watch_launcher()  # ends this rank when its launcher dies, even mid-step
    # A native crash (SIGSEGV, SIGABRT from a C++ std::terminate in torch or gloo) would
    # otherwise leave one bare line on stderr; this dumps every thread's Python stack with
    # it, so the log says where the rank was.
    faulthandler.enable()
    # torch comes only now, after the stop handler is in place (module doc).
    from pipetrain.runtime import PipelineError
    from pipetrain.runtime.errors import lost_peer_error

    entry, config_path = sys.argv[1:3] if argv is None else list(argv)
    module, _, function = entry.partition(":")
    train = getattr(importlib.import_module(module), function)
    role = role_from_env() or ProcessRole()
    timeout_s = PipelineConfig.timeout_s
    try:
        config = load_config(config_path)
        timeout_s = config.pipeline.timeout_s
        train(config, role, announced=True)
    except InputError as exc:
        sys.stderr.write(f"pipetrain train (rank {role.rank}): error: {exc}\n")
        return 2
    except (RunFailed, PipelineError) as exc:
        sys.stderr.write(f"pipetrain train (rank {role.rank}): {exc}\n")
        return 1
    except Exception as exc:
        # A collective outside the pipeline's own waits (stop flag, checkpoint, sample,
        # set-up) that failed because a peer died or went silent: one line, not a
        # traceback; anything else is a bug and keeps its traceback.
        failure = lost_peer_error(exc, rank=role.rank, timeout_s=timeout_s)
        if failure is None:
            raise
        _ask_doctor(role, str(failure), Path(config_path).parent)
        sys.stderr.write(f"pipetrain train (rank {role.rank}): {failure}\n")
        return 1
    except KeyboardInterrupt:
        # A second Ctrl-C (pipetrain.checkpoint.trainer.StopSignal): the user asked not
        # to wait for the step, so this is where the rank was, not a bug.
        sys.stderr.write(
            f"pipetrain train (rank {role.rank}): interrupted by a second Ctrl-C: the step "
            f"in progress was neither finished nor saved\n"
        )
        return 130
    return 0


def _ask_doctor(role: ProcessRole, error: str, run_dir: Path) -> None:
    """A collective outside the pipeline's waits failed on a peer: ask the hang doctor, as
    the pipeline does for its own waits, so that the launcher can name the rank that
    stopped answering first (launch.local) rather than the first one to time out."""
    if not role.distributed:
        return
    from pipetrain.launch.rendezvous import connect_store
    from pipetrain.runtime.hang import report_failure_outside

    with contextlib.suppress(Exception):  # the doctor never hides the error itself
        store = connect_store(role, _DOCTOR_STORE_S)
        report_failure_outside(
            store, rank=role.rank, world=role.world_size, error=error, report_dir=run_dir
        )


def _run() -> int:
    """``main``'s exit status; an unexpected exception prints its traceback and gives 1."""
    try:
        return main()
    except BaseException as exc:
        traceback.print_exc()
        # Every rank's traceback lands in one terminal: say whose it is.
        rank = _rank()
        text = str(exc).strip()
        summary = f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
        sys.stderr.write(
            f"pipetrain train (rank {rank}): failed on {summary} (the traceback above says where)\n"
        )
        return 1


if __name__ == "__main__":
    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, _stop_outside_training)
    # SIGUSR1 asks the hang doctor for a report (the launcher forwards its own); until the
    # pipeline's watch takes it over (pipetrain.runtime.hang), it must not end the rank.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    status = _run()
    # The rank's outcome is decided: a stop now must not record 0 over a failure.
    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, signal.SIG_IGN)
    record_exit(status)
    exit_rank(status)
