"""One live run per folder: an exclusive OS lock on ``<folder>/.pipetrain.lock``.

A run folder, a checkpoint directory and a metrics file written by two runs at once lose
data: one run's checkpoints replace the other's and the metrics interleave. So the
process that announces a run (``pipetrain.config.run_folder.announce``) locks each of
them before it writes anything, and holds the locks until the run ends.

The lock is ``flock(2)``, which belongs to an open file: the kernel drops it when that
process ends, however it ends (SIGKILL, a crash, the OOM killer), so a dead run never
leaves a stale lock and nothing has to be cleaned up by hand. The lock file itself stays;
it holds the holder's process id and host, so a refused run can name them.

The launcher of local ranks holds a second lock file, ``.pipetrain.ranks.lock``, only
while it checks the folders, and hands it to rank 0 before the ranks start: a launcher
killed with SIGKILL frees its own lock at once, but its ranks, stopped by the kernel's
parent-death signal, still finish their step and save for a few seconds, and a new run
must wait for them too. A new run takes both. Neither lock file is ever removed: a process that removed it while another waited to lock it would let a third
lock a new file of the same name, and two runs would hold "the" lock at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from pipetrain.config.errors import ConfigError

__all__ = [
    "LOCK_NAME",
    "RANKS_LOCK_NAME",
    "Holder",
    "LockedFolder",
    "RunLock",
    "RunLocked",
    "lock_folders",
]

LOCK_NAME = ".pipetrain.lock"
RANKS_LOCK_NAME = ".pipetrain.ranks.lock"

# A run that has just taken a lock writes its pid a moment later: a refused run waits this
# long to read it before it says the holder is unknown.
_READ_HOLDER_S = 1.0


class RunLocked(ConfigError):
    """A folder that a live run holds: the message names its pid and host and the fix."""


@dataclass(frozen=True)
class LockedFolder:
    """A folder (or file) to lock: where its lock file goes, and what it is for the
    messages."""

    target: Path
    lock_path: Path
    # What the user calls it and the flag that changes it: "run folder", "--name".
    label: str
    flag: str
    # The ranks' lock (``RANKS_LOCK_NAME``): a launcher hands it over to rank 0.
    ranks: bool = False


@dataclass(frozen=True)
class Holder:
    """Who holds a lock, as its lock file says (pid None: not written yet, or unreadable)."""

    pid: int | None
    host: str
    started: str

    def describe(self) -> str:
        if self.pid is None:
            return "another process (its pid is not written in the lock file yet)"
        where = "this host" if self.host == socket.gethostname() else f"host {self.host}"
        since = f", started {self.started}" if self.started else ""
        return f"process {self.pid} on {where}{since}"


class RunLock:
    """The locks of one run, held until ``release`` (or until this process ends)."""

    def __init__(
        self, fds: Sequence[int] = (), unsupported: Sequence[Path] = (), ranks: Sequence[int] = ()
    ) -> None:
        """``fds``: the open lock files (none: a process that holds no lock); ``ranks``:
        those of them that are the ranks' locks."""
        self._fds = list(fds)
        self._ranks = set(ranks)
        # Folders whose file system refused to lock (some network file systems): the run
        # goes on, unguarded there, and says so.
        self.unsupported = tuple(unsupported)

    def release(self) -> None:
        """Let go of every lock (again: nothing). Closing the file drops its flock."""
        fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def hand_over(self) -> None:
        """Let go of the ranks' locks only: the launcher, just before rank 0 takes them."""
        for fd in [fd for fd in self._fds if fd in self._ranks]:
            self._fds.remove(fd)
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()


def lock_folders(folders: Sequence[LockedFolder], *, resume: bool = False) -> RunLock:
    """Lock every folder of a run at once, or none: a folder that a live run holds is a
    ``RunLocked`` naming that run's pid and host (``resume``: this run meant to continue
    it), one that cannot be written a ``ConfigError``. The same lock file named twice (a
    checkpoint directory inside the run folder's path, say) is locked once."""
    fds: list[int] = []
    ranks: list[int] = []
    unsupported: list[Path] = []
    seen: set[str] = set()
    try:
        for folder in folders:
            key = os.path.realpath(folder.lock_path)
            if key in seen:
                continue
            seen.add(key)
            fd = _open(folder)
            fds.append(fd)
            if folder.ranks:
                ranks.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise _refusal(folder, fd, resume) from None
            except OSError:
                if not folder.ranks:  # ENOLCK, EOPNOTSUPP: no locks there (said once)
                    unsupported.append(folder.target)
                continue
            _write_holder(fd)
    except BaseException:
        RunLock(fds).release()
        raise
    return RunLock(fds, unsupported, ranks)


def _open(folder: LockedFolder) -> int:
    path = folder.lock_path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # O_CLOEXEC: the ranks this process starts must not inherit (and so keep) the lock.
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ConfigError(
            f"the {folder.label} {str(folder.target)!r} cannot be written ({exc.strerror}): "
            f"pass another {folder.flag}, or make it writable"
        ) from None


def _write_holder(fd: int) -> None:
    """This process's pid, host and start time into the lock file it now holds."""
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    text = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started})
    # Not worth failing over (a full disk lets nothing be written): the lock holds anyway,
    # and a refused run then says that the holder's pid is unknown.
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, (text + "\n").encode(), 0)


def _read_holder(fd: int) -> Holder:
    for _ in _attempts(_READ_HOLDER_S):
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            record = json.loads(os.pread(fd, 4096, 0).decode())
            return Holder(int(record["pid"]), str(record["host"]), str(record.get("started", "")))
    return Holder(None, "", "")


def _attempts(seconds: float) -> Iterator[None]:
    deadline = time.monotonic() + seconds
    yield
    while time.monotonic() < deadline:
        time.sleep(0.05)
        yield


def _refusal(folder: LockedFolder, fd: int, resume: bool) -> RunLocked:
    holder = _read_holder(fd)
    stop = f"stop it (kill -TERM {holder.pid} saves and stops it)" if holder.pid else "stop it"
    if resume:
        return RunLocked(
            f"--resume into a run that is still alive: the {folder.label} "
            f"{str(folder.target)!r} is held by {holder.describe()}; wait for it to "
            f"end, or {stop}, then resume"
        )
    return RunLocked(
        f"the {folder.label} {str(folder.target)!r} is in use by a live run "
        f"({holder.describe()}): pass another {folder.flag}, wait for that run to end, "
        f"or {stop}"
    )
