"""The ranks' torch.profiler traces merged into one Chrome/Perfetto trace, a track per rank.

Each rank's trace counts time on its own clock. The pipeline actions in it are ranges
named by ``pipetrain.runtime.ranges`` (``SEND_F stage 0 mb 3``), so the merge knows every
message's send and receive and aligns the clocks as the runtime aligns its measured
timelines (``pipetrain.runtime.timeline.clock_shifts``): each rank moves by the least
amount that makes every receive end after its send started. Every event of a rank's
trace (operators, kernels, memory) moves with it, onto a track named ``rank R``; the
merged trace's ``otherData.clock_shift_us`` records each rank's shift.

All ranks in one process (the debug mode) give one trace and one clock: its events go to
the track of the rank whose action range holds them.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pipetrain.runtime.ranges import parse_range_name
from pipetrain.runtime.timeline import clock_shifts
from pipetrain.schedules import Action, Kind
from pipetrain.schedules.execution import Event

__all__ = ["RankTrace", "merge_traces", "range_totals"]

TraceEvent = dict[str, Any]
# Micro-batch numbers of the n-th pass over an action (steps, accumulation) are moved by
# n times this, so that each message of every profiled pass is told apart when aligning.
_PASS = 1 << 20
# Tracks of a rank's other processes (a GPU's streams): 1000 + 100 x rank + k.
_DEVICE_TRACKS = 1000


@dataclass(frozen=True)
class RankTrace:
    """One process's exported trace (its ``traceEvents``) and its place in the run."""

    rank: int  # the process's global rank: its track
    events: Sequence[TraceEvent]
    # The pipeline rank it runs; None: every pipeline rank's actions (the debug mode).
    pipeline_rank: int | None
    replica: int = 0  # the pipeline replica (data/tensor-parallel coordinate)


def action_ranges(events: Sequence[TraceEvent]) -> list[tuple[Action, TraceEvent]]:
    """The complete events named after a pipeline action, in start order."""
    found = []
    for e in events:
        if e.get("ph") == "X":
            action = parse_range_name(str(e.get("name", "")))
            if action is not None:
                found.append((action, e))
    found.sort(key=lambda pair: float(pair[1]["ts"]))
    return found


def trace_shifts(traces: Sequence[RankTrace]) -> list[float]:
    """Per trace, the microseconds to add to its times (0 for traces of one clock)."""
    shifts = [0.0] * len(traces)
    replicas: dict[int, list[int]] = defaultdict(list)
    for i, trace in enumerate(traces):
        if trace.pipeline_rank is not None:
            replicas[trace.replica].append(i)
    for members in replicas.values():
        if len(members) < 2:
            continue
        num = 1 + max(traces[i].pipeline_rank or 0 for i in members)
        per_rank: list[tuple[Event, ...]] = [() for _ in range(num)]
        for i in members:
            rank = traces[i].pipeline_rank or 0
            per_rank[rank] = tuple(_message_events(rank, traces[i].events))
        found = clock_shifts(num, per_rank)
        for i in members:
            shifts[i] = found[traces[i].pipeline_rank or 0]
    return shifts


def _message_events(rank: int, events: Sequence[TraceEvent]) -> list[Event]:
    """The sends and receives of one rank's ranges, each pass's numbered apart."""
    seen: Counter[Action] = Counter()
    out = []
    for action, e in action_ranges(events):
        if not action.is_comm or action.microbatch is None:
            continue
        n = seen[action]
        seen[action] += 1
        moved = Action(action.stage, action.kind, action.microbatch + n * _PASS)
        start = float(e["ts"])
        out.append(Event(rank, moved, start, start + float(e.get("dur", 0.0))))
    return out


def merge_traces(
    traces: Sequence[RankTrace], rank_of_stage: Callable[[int], int]
) -> dict[str, Any]:
    """One Chrome trace of every rank's events on one clock, from time 0, a track per rank.

    ``rank_of_stage``: the pipeline rank of a global stage (the debug mode's tracks).
    """
    shifts = trace_shifts(traces)
    moved: list[TraceEvent] = []
    names: dict[int, str] = {}
    for trace, shift in zip(traces, shifts, strict=True):
        tracks = _tracks(trace, rank_of_stage, names)
        for e in trace.events:
            if e.get("ph") == "M" and e.get("name") in _PROCESS_META:
                continue  # replaced by the tracks' own names below
            out = dict(e)
            if "pid" in out:
                out["pid"] = tracks(e)
            if out.get("ph") != "M" and "ts" in out:
                out["ts"] = float(out["ts"]) + shift
            moved.append(out)
    timed = [float(e["ts"]) for e in moved if e.get("ph") != "M" and "ts" in e]
    origin = min(timed, default=0.0)
    for e in moved:
        e["ts"] = float(e["ts"]) - origin if e.get("ph") != "M" and "ts" in e else 0
    meta = []
    for pid, name in sorted(names.items()):
        meta.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
        meta.append(
            {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}}
        )
    # What the alignment moved each rank by, for a reader to judge it: on one host every
    # rank reads the same clock, so the shifts there stay near 0 (the e2e test checks it).
    shifted = {f"rank {t.rank}": shift for t, shift in zip(traces, shifts, strict=True)}
    return {
        "traceEvents": meta + moved,
        "displayTimeUnit": "ms",
        "otherData": {"clock_shift_us": shifted},
    }


_PROCESS_META = frozenset({"process_name", "process_labels", "process_sort_index"})


def _tracks(
    trace: RankTrace, rank_of_stage: Callable[[int], int], names: dict[int, str]
) -> Callable[[TraceEvent], int]:
    """The track of each of ``trace``'s events; records the tracks' names in ``names``."""
    host = _host_pid(trace.events)
    others: dict[Any, int] = {}
    for e in trace.events:
        pid = e.get("pid")
        if pid is not None and pid != host and pid not in others:
            others[pid] = _DEVICE_TRACKS + 100 * trace.rank + len(others)
            names[others[pid]] = f"rank {trace.rank} device {pid}"
    if trace.pipeline_rank is not None:
        names[trace.rank] = f"rank {trace.rank}"
        return lambda e: (
            trace.rank if e.get("pid") == host else others.get(e.get("pid"), trace.rank)
        )
    owner = _owners(trace.events, rank_of_stage)
    for rank in set(owner.values()) | {0}:
        names[rank] = f"rank {rank}"
    return lambda e: owner.get(id(e), 0) if e.get("pid") == host else others.get(e.get("pid"), 0)


def _host_pid(events: Sequence[TraceEvent]) -> Any:
    """The process id of the trace's host (CPU) events: that of its action ranges."""
    for e in events:
        if e.get("ph") == "X" and parse_range_name(str(e.get("name", ""))) is not None:
            return e.get("pid")
    return next((e.get("pid") for e in events if e.get("ph") == "X"), None)


def _owners(events: Sequence[TraceEvent], rank_of_stage: Callable[[int], int]) -> dict[int, int]:
    """Debug mode: for each host event (by ``id``) inside an action range on its thread,
    the pipeline rank of that action's stage."""
    by_thread: dict[Any, list[TraceEvent]] = defaultdict(list)
    for e in events:
        if e.get("ph") != "M" and "ts" in e:
            by_thread[e.get("tid")].append(e)
    owner: dict[int, int] = {}
    for thread in by_thread.values():
        thread.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
        rank, until = 0, -1.0
        for e in thread:
            action = parse_range_name(str(e.get("name", ""))) if e.get("ph") == "X" else None
            if action is not None:
                rank, until = rank_of_stage(action.stage), float(e["ts"]) + float(e.get("dur", 0))
            if float(e["ts"]) <= until:
                owner[id(e)] = rank
    return owner


def range_totals(merged: dict[str, Any]) -> dict[int, dict[str, float]]:
    """Per rank track, microseconds inside compute (F, B, I, W), send and receive ranges."""
    totals: dict[int, dict[str, float]] = defaultdict(
        lambda: {"compute": 0.0, "send": 0.0, "recv": 0.0}
    )
    for e in merged["traceEvents"]:
        if e.get("ph") != "X":
            continue
        action = parse_range_name(str(e.get("name", "")))
        if action is None:
            continue
        if action.is_compute:
            what = "compute"
        elif action.kind in (Kind.SEND_F, Kind.SEND_B):
            what = "send"
        elif action.kind in (Kind.RECV_F, Kind.RECV_B):
            what = "recv"
        else:
            continue
        totals[int(e["pid"])][what] += float(e.get("dur", 0.0))
    return dict(totals)
