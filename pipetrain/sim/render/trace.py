"""Chrome trace JSON of timelines (Perfetto, chrome://tracing), communication included.

The trace shows communication on a "comm" track below each rank's compute track: the
transfers between ranks (``transfers``: a compute-only schedule's are implicit, a delay on
each edge that crosses ranks, so they are recomputed from the placement), timed
all-reduces, and the data-parallel collectives (``LinkSpan``: ``--dp`` all-reduces,
``--shard`` gathers and reduce-scatters). Communication of zero length (the default free
network) is left out: it takes no time, and hundreds of empty slices would hide the work.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.deps import requirements
from pipetrain.schedules.execution import Event, Timeline
from pipetrain.schedules.placement import Placement
from pipetrain.sim.data_parallel import LinkSpan
from pipetrain.sim.metrics import live_activations
from pipetrain.sim.render.base import unwritable

__all__ = ["Transfer", "chrome_trace", "transfers", "write_chrome_trace"]


@dataclass(frozen=True)
class Transfer:
    """One message between ranks as the replay times it: it leaves ``src`` when
    ``carries`` ends there and reaches ``dst`` one transfer later, for ``needed_by``."""

    src: int
    dst: int
    start: float
    end: float
    carries: Action
    needed_by: Action


def transfers(timeline: Timeline, placement: Placement, transfer: float) -> tuple[Transfer, ...]:
    """The messages of ``timeline`` that take time (``transfer`` each, ``Costs.transfer()``).

    The same edges the replay delays (``pipetrain.schedules.execution``): every
    requirement that crosses ranks, timed from the end of the action it waits for. None
    when ``transfer`` is 0: free messages are not worth a slice.
    """
    if transfer <= 0:
        return ()
    lowered = any(e.action.is_comm for e in timeline.events)
    # The first run of an action is the one the replay's dependents wait for.
    done: dict[Action, Event] = {}
    for e in timeline.events:
        done.setdefault(e.action, e)
    out: list[Transfer] = []
    for e in timeline.events:
        if e.action.kind is Kind.ALLREDUCE:  # a collective, timed as its own event
            continue
        for req in requirements(e.action, placement, lowered=lowered):
            if not req.transfer:
                continue
            dep = next((done[a] for a in req.alternatives if a in done), None)
            if dep is not None:
                out.append(
                    Transfer(dep.rank, e.rank, dep.end, dep.end + transfer, dep.action, e.action)
                )
    return tuple(out)


def _lanes(spans: list[tuple[float, float]]) -> list[int]:
    """A lane for each span so that spans in one lane never overlap: a track's slices
    must nest, and two messages in flight at once do not."""
    ends: list[float] = []
    lane_of = [0] * len(spans)
    for i in sorted(range(len(spans)), key=lambda i: spans[i]):
        start, end = spans[i]
        lane = next((k for k, last in enumerate(ends) if last <= start), len(ends))
        if lane == len(ends):
            ends.append(end)
        else:
            ends[lane] = end
        lane_of[i] = lane
    return lane_of


def _on_comm_track(action: Action) -> bool:
    return action.is_comm or action.kind is Kind.ALLREDUCE


def _thread(pid: int, tid: int, name: str, order: int) -> list[dict[str, Any]]:
    return [
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}},
        {
            "name": "thread_sort_index",
            "ph": "M",
            "pid": pid,
            "tid": tid,
            "args": {"sort_index": order},
        },
    ]


def _comm_events(
    pid: int,
    tl: Timeline,
    messages: Sequence[Transfer],
    links: Sequence[LinkSpan],
    us_per_unit: float,
) -> list[dict[str, Any]]:
    """Sends, receives, timed all-reduces and dp collectives on comm tracks, with an
    arrow per message.

    Lane k of rank r is thread ``(k + 1) * num_ranks + r``, so the compute tracks keep
    thread = rank; it sorts right below rank r's compute track.
    """
    # (rank, start, end, name, category, args, flow: (message id, "s" or "f") or None)
    slices: list[tuple[int, float, float, str, str, dict[str, Any], tuple[int, str] | None]] = []
    for i, m in enumerate(messages):
        if m.end <= m.start:
            continue
        what = {"carries": str(m.carries), "for": str(m.needed_by), "from": m.src, "to": m.dst}
        # A lowered schedule's message goes from its SEND to its RECV: they name it.
        send = str(m.carries) if m.carries.is_comm else f"send {m.carries}"
        recv = str(m.needed_by) if m.needed_by.is_comm else f"recv {m.carries}"
        slices.append((m.src, m.start, m.end, send, "send", what, (i, "s")))
        slices.append((m.dst, m.start, m.end, recv, "recv", what, (i, "f")))
    for e in tl.events:
        # A simulated send or receive is a point (its time is in ``messages``); a measured
        # one, or a timed all-reduce, is a slice of its own.
        if _on_comm_track(e.action) and e.duration > 0:
            a = e.action
            args = {"stage": a.stage, "kind": a.kind.value, "microbatch": a.microbatch}
            slices.append((e.rank, e.start, e.end, str(a), _category(a.kind), args, None))
    for span in links:
        if span.end > span.start:
            slices.append((span.rank, span.start, span.end, span.name, "dp", {}, None))
    events: list[dict[str, Any]] = []
    named: set[int] = set()
    for rank in range(tl.num_ranks):
        mine = [s for s in slices if s[0] == rank]
        for (_, start, end, name, cat, args, flow), lane in zip(
            mine, _lanes([(s[1], s[2]) for s in mine]), strict=True
        ):
            tid = (lane + 1) * tl.num_ranks + rank
            if tid not in named:
                named.add(tid)
                label = f"rank {rank} comm" + (f" {lane + 1}" if lane else "")
                events.extend(_thread(pid, tid, label, rank * 1000 + lane + 1))
            ts = start * us_per_unit
            events.append(
                {
                    "name": name,
                    "cat": cat,
                    "ph": "X",
                    "pid": pid,
                    "tid": tid,
                    "ts": ts,
                    "dur": (end - start) * us_per_unit,
                    "args": args,
                }
            )
            if flow is not None:
                # An arrow from the send to its receive; "e" binds it to the enclosing slice.
                ident, phase = flow
                events.append(
                    {
                        "name": "message",
                        "cat": "flow",
                        "ph": phase,
                        "id": f"{pid}:{ident}",
                        "bp": "e",
                        "pid": pid,
                        "tid": tid,
                        "ts": ts,
                    }
                )
    return events


def chrome_trace(
    timelines: Timeline | Sequence[Timeline],
    *,
    us_per_unit: float = 1000.0,
    messages: Sequence[Sequence[Transfer]] | None = None,
    links: Sequence[Sequence[LinkSpan]] | None = None,
) -> dict[str, Any]:
    """Chrome trace JSON (Perfetto, chrome://tracing): process = schedule, thread = rank.

    Every event is a complete event named by the action text with its stage, kind and
    micro-batch in ``args``; a counter per rank follows its live activations (in stage x
    micro-batch units). ``us_per_unit`` converts timeline units to microseconds (the
    default shows one simulated unit as one millisecond; measured seconds want 1e6).

    ``messages``, one sequence per timeline (``transfers``), puts each message on a comm
    track of its sender ("send") and of its receiver ("recv"), linked by a flow arrow;
    timed all-reduces go there too, and ``links`` (one sequence per timeline), the dp
    collectives. Communication of zero length is left out (see the module docstring).
    """
    group = [timelines] if isinstance(timelines, Timeline) else list(timelines)
    sent: list[Sequence[Transfer]] = [()] * len(group) if messages is None else list(messages)
    dp: list[Sequence[LinkSpan]] = [()] * len(group) if links is None else list(links)
    if not len(sent) == len(dp) == len(group):
        raise ValueError(
            f"{len(sent)} message and {len(dp)} link lists for {len(group)} timelines: "
            "give one each"
        )
    events: list[dict[str, Any]] = []
    for pid, (tl, tl_messages, tl_links) in enumerate(zip(group, sent, dp, strict=True)):
        events.append(
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": tl.name}}
        )
        for rank in range(tl.num_ranks):
            events.extend(_thread(pid, rank, f"rank {rank}", rank * 1000))
        for e in tl.events:
            a = e.action
            if _on_comm_track(a):
                continue
            events.append(
                {
                    "name": str(a),
                    "cat": _category(a.kind),
                    "ph": "X",
                    "pid": pid,
                    "tid": e.rank,
                    "ts": e.start * us_per_unit,
                    "dur": e.duration * us_per_unit,
                    "args": {"stage": a.stage, "kind": a.kind.value, "microbatch": a.microbatch},
                }
            )
        events.extend(_comm_events(pid, tl, tl_messages, tl_links, us_per_unit))
        # One counter track per rank: live activations over time, beside the actions.
        for rank, curve in enumerate(live_activations(tl)):
            for time, level in curve:
                events.append(
                    {
                        "name": f"activations rank {rank}",
                        "ph": "C",
                        "pid": pid,
                        "ts": time * us_per_unit,
                        "args": {"live": level},
                    }
                )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(
    timelines: Timeline | Sequence[Timeline],
    path: str | Path,
    *,
    us_per_unit: float = 1000.0,
    messages: Sequence[Sequence[Transfer]] | None = None,
    links: Sequence[Sequence[LinkSpan]] | None = None,
) -> Path:
    """Write ``chrome_trace`` of the same arguments to ``path`` and return the path."""
    out = Path(path)
    trace = chrome_trace(timelines, us_per_unit=us_per_unit, messages=messages, links=links)
    text = json.dumps(trace) + "\n"
    try:
        out.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise unwritable(out, exc) from exc
    return out


def _category(kind: Kind) -> str:
    if kind in (Kind.F, Kind.B, Kind.I, Kind.W):
        return "compute"
    if kind in (Kind.ALLREDUCE, Kind.STEP):
        return "step"
    return "comm"
