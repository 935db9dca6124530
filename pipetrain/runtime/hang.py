"""Each rank's side of the hang doctor: its state, published through the rendezvous store.

When a pipeline hangs, each rank only knows its own side. This module lets every rank
tell the others where it is, through torch.distributed's key-value store (the TCPStore of
the rendezvous), which answers when the process group does not: a timed-out gloo pair,
a dead peer or a rank stopped with SIGSTOP leave the store working.

The record of what a rank did is the executor's ``ActionClock``: two preallocated slots
per action of its program (start, end), overwritten every step, in which the start is
written before the action runs. So the action in progress is the one whose start is the
latest reading and later than its end, and the last actions are the latest readings:
the ring buffer costs the hot loop nothing it did not already do. A ``HangWatch`` reads
it only when asked, from a daemon thread that also leaves a heartbeat in the store every
``poll_s`` (two store operations a second, off the step's thread).

A report is asked for (a *request* in the store) by the first rank whose wait fails
(``on_failure``, called by ``Pipeline`` before it raises its one-line error) or by a rank
that gets SIGUSR1 (the local launcher forwards its own). Every rank's thread then posts
its state; the asking rank collects what comes within ``window_s``, prints the wait-for
table and verdict (``pipetrain.diagnose.doctor``) on stderr and writes the report to
``report_dir/doctor.json``. A failing rank that is not the collector waits for the
report to be done (at most ``window_s`` and a little) before it goes on to exit: under a
plain ``env://`` start the store's server lives in rank 0's process.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import torch.distributed as dist

from pipetrain.diagnose.doctor import format_report
from pipetrain.runtime.executor import RankExecutor
from pipetrain.schedules import Action, Kind, Schedule

__all__ = ["REPORT_FILE", "HangWatch", "report_failure_outside", "watch_pipeline"]

REPORT_FILE = "doctor.json"

_PACKAGE = Path(__file__).resolve().parent.parent  # .../pipetrain
_PEER_RANK = re.compile(r"peer rank(?:\(s\))? (\d+)")


def _prefix() -> str:
    # An elastic restart starts every process again on the same store.
    return f"pipetrain/doctor/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def _run() -> str:
    """This launch: its launcher's run id and the restart (the reports' ids count per launch)."""
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}/{_prefix()}"


def _keeps_first_failure(path: Path, report: dict[str, Any]) -> bool:
    """Whether ``path`` holds an earlier failure report of this launch that ``report``, a
    later failure report, must not replace: the first one names the rank that stopped
    answering (the launcher's last line reads it), and by a later one the ranks that
    failed on it have exited and are silent too."""
    if report.get("by") != "failure":
        return False
    try:
        kept = json.loads(path.read_text())
        return bool(
            kept.get("by") == "failure"
            and kept.get("run") == report["run"]
            and kept["id"] < report["id"]
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _describe(action: Action, peer: int | None) -> str:
    """What a send or receive action moves, and with whom."""
    mb = action.microbatch
    if action.kind is Kind.RECV_F:
        return f"activations of micro-batch {mb} for stage {action.stage} from rank {peer}"
    if action.kind is Kind.RECV_B:
        return f"gradient of micro-batch {mb} for stage {action.stage} from rank {peer}"
    if action.kind is Kind.SEND_F:
        return f"sending activations of micro-batch {mb} to stage {action.stage + 1} on rank {peer}"
    return f"sending gradient of micro-batch {mb} to stage {action.stage - 1} on rank {peer}"


_PEER_STAGE = {Kind.RECV_F: -1, Kind.RECV_B: 1, Kind.SEND_F: 1, Kind.SEND_B: -1}


class HangWatch:
    """One process's publisher and, when it asks, collector of the doctor's reports."""

    def __init__(
        self,
        store: Any,
        *,
        rank: int,
        world: int,
        executors: Sequence[RankExecutor],
        stage_ranks: dict[int, int],
        group_ranks: Sequence[int],
        window_s: float = 3.0,
        poll_s: float = 0.5,
        out: IO[str] | None = None,
    ) -> None:
        """``stage_ranks``: stage -> global rank; ``group_ranks``: the pipeline group's
        rank -> global rank (errors number ranks within the group)."""
        self.store = store
        self.rank = rank
        self.world = world
        self.report_dir: Path | None = None
        self.window_s = window_s
        self.poll_s = poll_s
        self.last_report: dict[str, Any] | None = None
        self._executors = tuple(executors)
        self._stage_ranks = dict(stage_ranks)
        self._group_ranks = tuple(group_ranks)
        self._out = out
        self._prefix = _prefix()
        self._error = ""
        self._asked = False
        self._seen = 0  # the last request this process posted its state for
        self._stop = threading.Event()
        self._main = threading.main_thread().ident
        self._thread: threading.Thread | None = None

    def follow(self, executors: Sequence[RankExecutor]) -> None:
        """Read these executors from now on (``Pipeline.reschedule``'s new program)."""
        self._executors = tuple(executors)

    # ----------------------------------------------------------------- the state
    def snapshot(self) -> dict[str, Any]:
        """This rank's state from its executors' clocks (module doc), JSON-ready."""
        now = time.perf_counter_ns()
        best: tuple[int, RankExecutor, int] | None = None  # (start, executor, position)
        for ex in self._executors:
            times = ex.clock.times
            for pos in range(len(ex.actions)):
                if best is None or times[2 * pos] > best[0]:
                    best = (times[2 * pos], ex, pos)
        state: dict[str, Any] = {
            "rank": self.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "state": "outside",
            "action": None,
            "for_s": None,
            "waits_on": None,
            "message": "",
            "where": "",
            "frame": self._frame(),
            "error": self._error,
            "recent": [],
            "time": time.time(),
        }
        if best is None or best[0] == 0:  # no action ran yet
            return self._failed(state)
        start, ex, pos = best
        times = ex.clock.times
        action = ex.actions[pos]
        state["where"] = ex.where
        state["recent"] = _recent(ex, now)
        state["action"] = str(action)
        if times[2 * pos + 1] >= start:  # it ended: between actions, or between steps
            state["for_s"] = (now - times[2 * pos + 1]) * 1e-9
            return self._failed(state)
        state["for_s"] = (now - start) * 1e-9
        offset = _PEER_STAGE.get(action.kind)
        if offset is None:
            state["state"] = "computing"
            return self._failed(state) if self._error else state
        peer = self._stage_ranks.get(action.stage + offset)
        state.update(state="waiting", waits_on=peer, message=_describe(action, peer))
        return state

    def _failed(self, state: dict[str, Any]) -> dict[str, Any]:
        """A failed rank waits on the peer its error names, if it names one."""
        if not self._error:
            return state
        found = _PEER_RANK.search(self._error)
        peer = int(found.group(1)) if found else None
        if peer is not None and peer < len(self._group_ranks):
            peer = self._group_ranks[peer]
        state.update(state="failed", waits_on=peer)
        if not state["message"]:
            state["message"] = self._error.splitlines()[0]
        return state

    def _frame(self) -> str:
        """The innermost pipetrain function of the main thread, as ``name (path:line)``."""
        frame = sys._current_frames().get(self._main) if self._main is not None else None
        while frame is not None:
            path = Path(frame.f_code.co_filename)
            if path.is_relative_to(_PACKAGE) and path.name != "hang.py":
                name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
                relative = path.relative_to(_PACKAGE.parent).as_posix()
                return f"{name} ({relative}:{frame.f_lineno})"
            frame = frame.f_back
        return ""

    # ----------------------------------------------------------------- the store
    def _key(self, *parts: object) -> str:
        return self._prefix + "/".join(map(str, parts))

    def _post(self, key: str, value: dict[str, Any]) -> None:
        self.store.set(key, json.dumps(value))

    def _read(self, key: str) -> dict[str, Any] | None:
        # ``check`` first: a ``get`` of a missing key blocks until the store's timeout.
        if not self.store.check([key]):
            return None
        value: dict[str, Any] = json.loads(self.store.get(key))
        return value

    def _request(self, reason: str, by: str) -> dict[str, Any]:
        """Open a request, or join one of the same kind opened in the last moments (every
        rank's wait fails at about the same time; the launcher signals every rank)."""
        key = self._key("request")
        fresh = self.window_s + 5.0
        got: dict[str, Any] = {}
        for _ in range(8):
            old = self.store.get(key).decode() if self.store.check([key]) else ""
            current = json.loads(old) if old else None
            if current and current["by"] == by and time.time() - current["time"] < fresh:
                return dict(current)
            number = current["id"] + 1 if current else 1
            new = json.dumps(
                {
                    "id": number,
                    "collector": self.rank,
                    "reason": reason,
                    "by": by,
                    "time": time.time(),
                }
            )
            answer = self.store.compare_set(key, old, new).decode()
            got = json.loads(answer)
            if answer == new:
                return got
        return got

    def _collect(self, request: dict[str, Any]) -> dict[str, Any]:
        """Every registered rank's state for ``request``, waiting at most ``window_s``."""
        ranks = [r for r in range(self.world) if self.store.check([self._key("alive", r)])]
        keys = {r: self._key(request["id"], r) for r in ranks}
        deadline = time.monotonic() + self.window_s
        while time.monotonic() < deadline and not self.store.check(list(keys.values())):
            time.sleep(0.05)
        now = time.time()
        states: dict[str, Any] = {}
        seen: dict[str, Any] = {}
        for r, key in keys.items():
            state = self._read(key)
            if state is None:
                beat = self._read(self._key("alive", r))
                if beat is not None:
                    beat["age_s"] = now - beat["time"]
                    seen[str(r)] = beat
            else:
                state["age_s"] = now - state["time"]
            states[str(r)] = state
        return {
            **request,
            "run": _run(),
            "window_s": self.window_s,
            "collected_at": now,
            "ranks": states,
            "last_seen": seen,
        }

    def _report(self, request: dict[str, Any]) -> None:
        """Collect, print and save the report of ``request``; then mark it done."""
        try:
            report = self._collect(request)
            self.last_report = report
            text = format_report(report)
            out = self._out if self._out is not None else sys.stderr
            out.write("".join(f"[doctor] {line}\n" for line in text.splitlines()))
            out.flush()
            if self.report_dir is not None:
                with contextlib.suppress(OSError):
                    path = self.report_dir / REPORT_FILE
                    if not _keeps_first_failure(path, report):
                        path.parent.mkdir(parents=True, exist_ok=True)
                        path.write_text(json.dumps(report, indent=1) + "\n")
        finally:
            self.store.set(self._key(request["id"], "done"), "1")

    # ----------------------------------------------------------------- the triggers
    def on_failure(self, error: str) -> None:
        """A wait of this rank failed with ``error``: post this rank's state, ask for a
        report (or join the one asked for), and collect it or wait until it is done."""
        with contextlib.suppress(Exception):  # the doctor never hides the error itself
            self._error = error
            self._post(self._key("alive", self.rank), self.snapshot())
            request = self._request(f"rank {self.rank} failed: {error.splitlines()[0]}", "failure")
            self._post(self._key(request["id"], self.rank), self.snapshot())
            if request["collector"] == self.rank:
                self._report(request)
                return
            done = self._key(request["id"], "done")
            deadline = time.monotonic() + self.window_s + 2.0
            while time.monotonic() < deadline and not self.store.check([done]):
                time.sleep(0.05)

    def ask(self, signum: int = 0, frame: Any = None) -> None:
        """SIGUSR1: report on the run as it stands (the thread does the work)."""
        self._asked = True

    # ----------------------------------------------------------------- the thread
    def start(self) -> None:
        """Register this rank and start its thread (again, after ``stop``)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._post(self._key("alive", self.rank), self.snapshot())
        self._thread = threading.Thread(target=self._loop, name="pipetrain-doctor", daemon=True)
        self._thread.start()

    def stop(self, wait: bool = False) -> None:
        """End the thread (``wait``: until it has ended); reports need it running."""
        self._stop.set()
        if wait and self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        with contextlib.suppress(Exception):  # the store went away: the run is over
            while not self._stop.wait(self.poll_s):
                if self._asked:
                    self._asked = False
                    self._request(f"SIGUSR1 to rank {self.rank}", "signal")
                state = self.snapshot()
                self._post(self._key("alive", self.rank), state)
                request = self._read(self._key("request"))
                if request is None or request["id"] <= self._seen:
                    continue
                self._seen = request["id"]
                self._post(self._key(request["id"], self.rank), state)
                if request["collector"] == self.rank and request["by"] == "signal":
                    self._report(request)


def _recent(ex: RankExecutor, now: int, count: int = 8) -> list[list[Any]]:
    """The last ``count`` actions started, latest first: [action, s since start, s since
    end or None while it runs]."""
    times = ex.clock.times
    order = sorted(range(len(ex.actions)), key=lambda p: times[2 * p], reverse=True)[:count]
    return [
        [
            str(ex.actions[p]),
            (now - times[2 * p]) * 1e-9,
            (now - times[2 * p + 1]) * 1e-9 if times[2 * p + 1] >= times[2 * p] else None,
        ]
        for p in order
        if times[2 * p]
    ]


def watch_pipeline(
    owner: object, group: Any, schedule: Schedule, executors: Sequence[RankExecutor]
) -> HangWatch | None:
    """Start a ``HangWatch`` for a pipeline (``owner``) on ``group``, stopped when the
    owner is collected; None without a process group or its store."""
    if group is None or not dist.is_initialized():
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
    except Exception:
        return None
    group_ranks = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
    stage_ranks = {s: group_ranks[r] for s, r in enumerate(schedule.placement.stage_to_rank)}
    watch = HangWatch(
        store,
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        executors=executors,
        stage_ranks=stage_ranks,
        group_ranks=group_ranks,
    )
    watch.start()
    weakref.finalize(owner, watch.stop)
    # SIGUSR1 asks for a report, unless the program uses the signal for something else
    # (a newer pipeline's watch takes it over from an older one's).
    current = signal.getsignal(signal.SIGUSR1)
    ours = isinstance(getattr(current, "__self__", None), HangWatch)
    free = current in (signal.SIG_DFL, signal.SIG_IGN, None) or ours
    if free and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, watch.ask)
    return watch


def report_failure_outside(
    store: Any, *, rank: int, world: int, error: str, report_dir: Path | None
) -> None:
    """A wait outside the pipeline's actions (a collective of the trainer) failed with
    ``error``: ask for a report as ``on_failure`` does, as a rank between actions. The
    other ranks' watches answer; one that stopped answering shows up silent."""
    others = [f"{_prefix()}alive/{r}" for r in range(world) if r != rank]
    if not any(store.check([key]) for key in others):
        return  # no rank of this run has a watch (no pipeline group): nothing to collect
    watch = HangWatch(
        store, rank=rank, world=world, executors=(), stage_ranks={}, group_ranks=range(world)
    )
    watch.report_dir = report_dir
    watch.on_failure(error)
