"""One process of a launched run: ``python -m pipetrain.train.worker CONFIG.toml``.

Started by ``launch.launch_local`` with torch.distributed's environment set. Errors are
one line on stderr naming the rank; exit status 2 for bad input, 1 for a failed run. The
process ends through ``launch.exit_rank``, without the interpreter's finalization, which
gloo's threads can turn into a SIGABRT after a successful run (its docstring says how).
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from pipetrain.errors import InputError
from pipetrain.runtime import PipelineError
from pipetrain.runtime.errors import lost_peer_error
from pipetrain.train.config import PipelineConfig, load_config
from pipetrain.train.launch import exit_rank, exit_record, role_from_env
from pipetrain.train.loop import ProcessRole, train
from pipetrain.train.optim import TrainingDiverged

__all__ = ["main"]


def _stop_with_launcher() -> None:
    """Linux: have the kernel send this rank SIGTERM when its launcher dies.

    torch's launcher starts each rank in a session of its own and stops the ranks itself
    when it is signalled; killed (SIGKILL, the OOM killer), it cannot, and its ranks would
    train on as orphans. SIGTERM is the stop signal the trainer obeys: finish the step,
    save, exit. (The kernel watches the thread that started the process: the launcher's
    main thread, which runs its agent.)
    """
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1  # <linux/prctl.h>
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0) != 0:
        return  # not worth failing the run over: the launcher's own stop still works
    if os.getppid() == 1:  # the launcher died before the request was in place
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: Sequence[str] | None = None) -> int:
    _stop_with_launcher()
    # A native crash (SIGSEGV, SIGABRT from a C++ std::terminate in torch or gloo) would
    # otherwise leave one bare line on stderr; this dumps every thread's Python stack with
    # it, so the log says where the rank was.
    faulthandler.enable()
    args = sys.argv[1:] if argv is None else list(argv)
    role = role_from_env() or ProcessRole()
    timeout_s = PipelineConfig.timeout_s
    try:
        config = load_config(args[0])
        timeout_s = config.pipeline.timeout_s
        train(config, role, announced=True)
    except InputError as exc:
        sys.stderr.write(f"pipetrain train (rank {role.rank}): error: {exc}\n")
        return 2
    except (TrainingDiverged, PipelineError) as exc:
        sys.stderr.write(f"pipetrain train (rank {role.rank}): {exc}\n")
        return 1
    except Exception as exc:
        # A collective outside the pipeline's own waits (stop flag, checkpoint, sample,
        # set-up) that failed because a peer died or went silent: one line, not a
        # traceback; anything else is a bug and keeps its traceback.
        failure = lost_peer_error(exc, rank=role.rank, timeout_s=timeout_s)
        if failure is None:
            raise
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


def _run() -> int:
    """``main``'s exit status; an unexpected exception prints its traceback and gives 1."""
    try:
        return main()
    except BaseException as exc:
        traceback.print_exc()
        # Every rank's traceback lands in one terminal: say whose it is.
        rank = (role_from_env() or ProcessRole()).rank
        text = str(exc).strip()
        summary = f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
        sys.stderr.write(
            f"pipetrain train (rank {rank}): failed on {summary} (the traceback above says where)\n"
        )
        return 1


def _record(code: int) -> None:
    """Leave the exit status where the local launcher looks after a stop signal."""
    role = role_from_env()
    if role is None or len(sys.argv) < 2:
        return
    path = exit_record(Path(sys.argv[1]), role.rank)
    # Unwritable: the launcher then counts this rank as killed, which errs on the safe side.
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{code}\n")


if __name__ == "__main__":
    status = _run()
    _record(status)
    exit_rank(status)
