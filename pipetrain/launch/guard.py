"""Two watches that keep a rank from running on when it should have stopped.

``StopGrace``: SIGTERM during a training step only sets the trainer's flag
(``pipetrain.checkpoint.trainer.StopSignal``), obeyed when the step ends. A step that
does not end (minutes of compute in one op, a wait on a stopped peer) would defer the
stop without limit, and Python runs a signal's handler only between bytecodes, so no
handler can cut a long op short. The C-level handler does write the signal's number to
``signal.set_wakeup_fd`` at once, though: a thread reading that pipe learns of the
signal while the main thread is still inside the op. When the step has not ended
``grace_s`` later, the thread ends the process (status 143, one line; the step is lost,
earlier checkpoints stay).

``watch_launcher``: a rank started by torchrun's agent or the local launcher stops when
its launcher dies. Linux sends it SIGTERM then (``PR_SET_PDEATHSIG``, asked for here);
a thread also polls the parent's process id (other systems, or a parent that died
before the request was in place) and sends the same SIGTERM. A rank that has not ended
``ORPHAN_LIMIT_S`` after its launcher's death ends there (status 143), whatever it was
doing: with the launcher its rendezvous store is gone, and no one else will stop it.

Neither imports torch: the worker starts both before torch is imported.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import threading
import time

from pipetrain.launch.process_exit import launched_rank, record_exit

__all__ = ["ORPHAN_LIMIT_S", "STOP_STATUS", "StopGrace", "watch_launcher"]

STOP_STATUS = 128 + signal.SIGTERM  # as a shell reports a process ended by SIGTERM
ORPHAN_LIMIT_S = 10.0
_POLL_S = 0.5
_FLUSH_S = 1.0  # how long an ending process waits for its buffered output


def _label() -> str:
    rank = os.environ.get("RANK") if launched_rank() else None
    return "pipetrain train" if rank is None else f"pipetrain train (rank {rank})"


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def end_now(line: str) -> None:
    """Write ``line`` on stderr, leave the exit record and end the process with status 143.

    Called from a watch's thread while the main thread may hold a stream's lock (stuck
    in a write to a full pipe): the flush runs on a thread of its own, waited for at most
    ``_FLUSH_S``, and the line goes out with ``os.write``."""
    flusher = threading.Thread(target=_flush, daemon=True)
    flusher.start()
    flusher.join(_FLUSH_S)
    with contextlib.suppress(OSError):
        os.write(2, f"{_label()}: {line}\n".encode())
    record_exit(STOP_STATUS)
    os._exit(STOP_STATUS)


class StopGrace:
    """The time a training step gets after SIGTERM before the process ends (module doc).

    ``start`` (main thread) installs the wakeup pipe and the thread; ``release`` says the
    stop is obeyed (the step ended, the save and exit follow) and disarms the deadline;
    ``close`` puts the previous wakeup fd back and ends the thread."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._released = threading.Event()
        self._closed = threading.Event()
        self._pipe: tuple[int, int] | None = None
        self._previous = -1
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Watch for SIGTERM; False where it cannot (not the main thread)."""
        if threading.current_thread() is not threading.main_thread() or self._pipe:
            return False
        read, write = os.pipe()
        os.set_blocking(write, False)  # the C handler must never block on it
        try:
            self._previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:
            os.close(read)
            os.close(write)
            return False
        self._pipe = (read, write)
        self._thread = threading.Thread(target=self._watch, name="pipetrain-stop", daemon=True)
        self._thread.start()
        return True

    def release(self) -> None:
        self._released.set()

    def close(self) -> None:
        if self._pipe is None:
            return
        self._closed.set()
        if threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(self._previous)
        with contextlib.suppress(OSError):
            os.write(self._pipe[1], b"\0")  # wakes the thread at once
        if self._thread is not None:
            self._thread.join()
        for fd in self._pipe:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._pipe = None

    def _watch(self) -> None:
        assert self._pipe is not None
        read = self._pipe[0]
        deadline: float | None = None
        while not self._closed.is_set():
            wait = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            ready, _, _ = select.select([read], [], [], max(wait, 0.0))
            if ready and signal.SIGTERM in os.read(read, 512) and deadline is None:
                deadline = time.monotonic() + self.grace_s
            if self._released.is_set():
                return
            if deadline is not None and time.monotonic() >= deadline and not self._closed.is_set():
                end_now(
                    f"SIGTERM came {self.grace_s:g} s ago, during a training step that has "
                    f"not ended: stopped without finishing or saving it (the checkpoints "
                    f"saved before stay; run.stop_grace_s sets how long a step may finish)"
                )


def _ask_parent_death_signal() -> None:
    """Linux: the kernel sends this process SIGTERM when its parent thread ends. (It
    watches the thread that started the process: the launcher's agent thread.)"""
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1  # <linux/prctl.h>
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)


def watch_launcher() -> bool:
    """Stop this rank when its launcher dies (module doc); False when it has none: not
    started by an elastic agent (torchrun or the local launcher), whose TORCHELASTIC_RUN_ID
    every rank gets, e.g. a process started by hand with RANK and WORLD_SIZE."""
    if not launched_rank() or "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    parent = os.getppid()
    if parent == 1:
        # A launcher that is process 1 (torchrun as a container's entry point) cannot be
        # told from one that died before this line: nothing to watch.
        return False
    _ask_parent_death_signal()
    thread = threading.Thread(
        target=_watch_parent, args=(parent,), name="pipetrain-launcher", daemon=True
    )
    thread.start()
    return True


def _watch_parent(parent: int) -> None:
    # Adopted by init or a subreaper: the launcher has died.
    while os.getppid() == parent:
        time.sleep(_POLL_S)
    # The stop a rank obeys (finish the step and save, or end at once outside the steps);
    # Linux has usually sent it already.
    with contextlib.suppress(OSError):
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(ORPHAN_LIMIT_S)
    end_now(
        f"its launcher (process {parent}) died {ORPHAN_LIMIT_S:g} s ago and this rank had not "
        f"stopped: ended without finishing its step (the checkpoints saved before stay)"
    )
