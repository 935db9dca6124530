"""Measured timelines: the start and end of every action, always recorded, cheaply.

Each rank writes ``time.perf_counter_ns()`` readings into a list allocated once per
program (two slots per action), relative to a barrier at the start of the step. The lists
become the simulator's ``Timeline`` type, in seconds, so the same metrics and pictures
apply to a measured run and a simulated one.

The ranks leave the barrier at different moments (a process woken late on a busy machine
leaves it milliseconds after its peers), so their origins differ; ``merge_timelines``
moves each rank's events by the least amount that makes every receive end after its
send started, which a common clock would have shown.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from pipetrain.schedules import Action, Kind, Schedule
from pipetrain.schedules.execution import Costs, Event, Timeline
from pipetrain.sim import Bubble, bubble, simulate

__all__ = [
    "ActionClock",
    "SimComparison",
    "clock_shifts",
    "compare_with_simulation",
    "gathered_timeline",
    "measured_costs",
    "merge_timelines",
    "rank_events",
    "simulated_bubble",
]

_NS = 1e-9


class ActionClock:
    """Preallocated (start, end) slots, in nanoseconds, for one rank's actions of a step."""

    __slots__ = ("origin_ns", "times")

    def __init__(self, num_actions: int) -> None:
        self.times: list[int] = [0] * (2 * num_actions)
        self.origin_ns = 0

    def relative(self) -> list[int]:
        """The readings as nanoseconds since the step's origin."""
        origin = self.origin_ns
        return [t - origin for t in self.times]


def rank_events(
    rank: int, actions: Sequence[Action], relative_ns: Sequence[float]
) -> tuple[Event, ...]:
    """One rank's events from its actions and (start, end) readings since the origin."""
    return tuple(
        Event(rank, action, relative_ns[2 * i] * _NS, relative_ns[2 * i + 1] * _NS)
        for i, action in enumerate(actions)
    )


def gathered_timeline(schedule: Schedule, rows: Sequence[Sequence[float]], skip: int) -> Timeline:
    """The step's timeline from every rank's row of a step summary: ``skip`` values, then
    the rank's (start, end) readings of its actions of ``schedule``."""
    per_rank = [
        rank_events(r, schedule.actions[r], rows[r][skip : skip + 2 * len(schedule.actions[r])])
        for r in range(schedule.num_ranks)
    ]
    return merge_timelines(schedule.name, schedule.num_ranks, per_rank)


def merge_timelines(name: str, num_ranks: int, per_rank: Sequence[tuple[Event, ...]]) -> Timeline:
    """All ranks' events in one timeline on one time axis, ordered by start time."""
    shifts = clock_shifts(num_ranks, per_rank)
    events = sorted(
        (
            dataclasses.replace(e, start=e.start + shifts[e.rank], end=e.end + shifts[e.rank])
            if shifts[e.rank]
            else e
            for events in per_rank
            for e in events
        ),
        key=lambda e: (e.start, e.rank),
    )
    return Timeline(name, num_ranks, tuple(events))


# A receive of (kind, stage, micro-batch) matches the send of (kind, stage, micro-batch).
_SENT_BY = {Kind.RECV_F: (Kind.SEND_F, -1), Kind.RECV_B: (Kind.SEND_B, +1)}


def clock_shifts(num_ranks: int, per_rank: Sequence[tuple[Event, ...]]) -> list[float]:
    """Per rank, the least non-negative time to add to its events so that no receive ends
    before its message's send started (each rank's times count from its own origin).

    Each message from rank s to rank d bounds ``shift[d] - shift[s]`` from below; raising
    shifts until every bound holds is a longest-path search (Bellman-Ford), which settles
    within ``num_ranks`` rounds because real clocks satisfy every bound (no cycle of them
    gains time). A timeline already causal (one process, one clock) is left as it is.
    """
    sends: dict[tuple[Kind, int, int | None], Event] = {}
    for events in per_rank:
        for e in events:
            if e.action.kind in (Kind.SEND_F, Kind.SEND_B):
                sends[(e.action.kind, e.action.stage, e.action.microbatch)] = e
    bound: dict[tuple[int, int], float] = {}
    for events in per_rank:
        for e in events:
            sent_by = _SENT_BY.get(e.action.kind)
            if sent_by is None:
                continue
            send = sends.get((sent_by[0], e.action.stage + sent_by[1], e.action.microbatch))
            if send is None or send.rank == e.rank:
                continue
            pair = (send.rank, e.rank)
            bound[pair] = max(bound.get(pair, -math.inf), send.start - e.end)
    shifts = [0.0] * num_ranks
    for _ in range(num_ranks):
        changed = False
        for (src, dst), gap in bound.items():
            if shifts[dst] < shifts[src] + gap:
                shifts[dst] = shifts[src] + gap
                changed = True
        if not changed:
            break
    return shifts


def measured_costs(timeline: Timeline, schedule: Schedule) -> Costs:
    """Per-model-stage median durations of F, B, I and W (seconds) in a measured timeline.

    A schedule that never splits the backward gets I = W = B/2, one that never runs B gets
    B = I + W, so the costs also fit a schedule of the other kind.
    """
    placement = schedule.placement
    samples: dict[tuple[Kind, int], list[float]] = defaultdict(list)
    for event in timeline.events:
        if event.action.is_compute or event.action.kind is Kind.ALLREDUCE:
            samples[(event.action.kind, placement.model_stage(event.action.stage))].append(
                event.duration
            )

    def median(kind: Kind, stage: int) -> float | None:
        values = samples.get((kind, stage))
        return statistics.median(values) if values else None

    n = placement.num_model_stages
    forward, backward, inputs, weights = [], [], [], []
    for stage in range(n):
        f, b, i, w = (median(k, stage) for k in (Kind.F, Kind.B, Kind.I, Kind.W))
        if b is None and i is not None and w is not None:
            b = i + w
        if b is not None and i is None:
            i = w = b / 2
        forward.append(f or 0.0)
        backward.append(b or 0.0)
        inputs.append(i or 0.0)
        weights.append(w or 0.0)
    allreduce = [e.duration for e in timeline.events if e.action.kind is Kind.ALLREDUCE]
    # An asynchronous schedule's optimizer steps are actions too (PipeDream has one per
    # micro-batch): left at 0 they would shorten the replay and hide their share of the step.
    steps = [e.duration for e in timeline.events if e.action.kind is Kind.STEP]
    return Costs(
        forward=tuple(forward),
        backward=tuple(backward),
        backward_input=tuple(inputs),
        backward_weight=tuple(weights),
        allreduce=statistics.median(allreduce) if allreduce else 0.0,
        step=statistics.median(steps) if steps else 0.0,
    )


@dataclass(frozen=True)
class SimComparison:
    """A measured step next to the simulator's replay of the same schedule."""

    measured_makespan_s: float  # first action start to last action end, all ranks
    simulated_makespan_s: float  # replay with the measured median action times
    measured_bubble: Bubble
    simulated_bubble: Bubble

    @property
    def ratio(self) -> float:
        """Measured over simulated makespan (1.0: the runtime adds nothing to the actions)."""
        return (
            self.measured_makespan_s / self.simulated_makespan_s
            if self.simulated_makespan_s
            else 0.0
        )


def compare_with_simulation(timeline: Timeline, schedule: Schedule) -> SimComparison:
    """Replay ``schedule`` with the action times measured in ``timeline`` and compare."""
    simulated = simulate(schedule, measured_costs(timeline, schedule))
    return SimComparison(timeline.makespan, simulated.makespan, bubble(timeline), simulated.bubble)


def simulated_bubble(timelines: Sequence[Timeline], schedule: Schedule) -> float | None:
    """Idle share (GPipe definition) of ``schedule`` replayed with the median action times
    measured over ``timelines`` (several runs of that schedule); None without any."""
    if not timelines:
        return None
    # The medians do not care when an event ran, so the runs' events pool into one timeline.
    pooled = Timeline(
        schedule.name, schedule.num_ranks, tuple(e for t in timelines for e in t.events)
    )
    return simulate(schedule, measured_costs(pooled, schedule)).bubble.idle_fraction
