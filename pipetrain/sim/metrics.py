"""Metrics of a timeline: busy and idle time, the three bubbles, live activations and
weight versions.

Every function takes a plain ``Timeline``, so the same numbers come out of a simulated
replay and of events measured by the runtime. Times are in the timeline's own unit.

What counts as work: compute actions (F, B, I, W) and the step-level actions (ALLREDUCE,
STEP). Sends and receives are not work: a rank sitting in a receive is waiting, which is
exactly the bubble. Overlapping events of one rank (a measured timeline with an
asynchronous send) are merged, so no instant counts twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pipetrain.schedules.actions import Kind
from pipetrain.schedules.execution import Event, Timeline

__all__ = [
    "Bubble",
    "RankTimes",
    "bubble",
    "busy_time",
    "live_activations",
    "peak_activation_bytes",
    "peak_activations",
    "peak_with_gradients",
    "rank_times",
    "stage_weight_versions",
    "weight_versions",
]

_BACKWARD_KINDS = frozenset({Kind.B, Kind.I, Kind.W})


def _is_work(event: Event) -> bool:
    return not event.action.is_comm


def _union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping intervals."""
    total = 0.0
    cur_start: float | None = None
    cur_end = 0.0
    for start, end in sorted(intervals):
        if cur_start is None or start > cur_end:
            if cur_start is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_start is not None:
        total += cur_end - cur_start
    return total


def busy_time(events: Iterable[Event]) -> float:
    """Time covered by work (not sends or receives) among ``events``."""
    return _union_length((e.start, e.end) for e in events if _is_work(e))


@dataclass(frozen=True)
class RankTimes:
    """Per-rank time accounting, each tuple indexed by rank.

    ``idle[r] = makespan - busy[r]`` counts the staggered start and the drain;
    ``span_idle[r]`` counts only the idle time between rank r's first and last work.
    """

    busy: tuple[float, ...]
    idle: tuple[float, ...]
    span: tuple[float, ...]
    span_idle: tuple[float, ...]


def rank_times(timeline: Timeline) -> RankTimes:
    makespan = timeline.makespan
    busy: list[float] = []
    span: list[float] = []
    for rank in range(timeline.num_ranks):
        work = [e for e in timeline.of_rank(rank) if _is_work(e)]
        busy.append(busy_time(work))
        span.append(max(e.end for e in work) - min(e.start for e in work) if work else 0.0)
    return RankTimes(
        busy=tuple(busy),
        idle=tuple(makespan - b for b in busy),
        span=tuple(span),
        span_idle=tuple(s - b for s, b in zip(span, busy, strict=True)),
    )


@dataclass(frozen=True)
class Bubble:
    """The bubble under the three definitions in the literature (they disagree).

    - ``idle_fraction`` (GPipe): total idle time over ``ranks x makespan``.
    - ``over_ideal`` (Megatron): total idle time over total work time, i.e. bubble time
      over ideal compute time; GPipe and 1F1B give ``(p-1)/m``.
    - ``per_rank_span_time`` (Zero Bubble, DualPipe): the worst rank's idle time inside
      its own first-to-last-work span, which ignores the staggered start;
      ``per_rank_span_fraction`` is the worst rank's idle share of its own span.
    - ``idle_time``: the worst rank's idle time against the whole makespan; the papers'
      "bubble (p-1)(F+B)" for GPipe and 1F1B.
    """

    idle_fraction: float
    over_ideal: float
    per_rank_span_time: float
    per_rank_span_fraction: float
    idle_time: float


def bubble(timeline: Timeline, times: RankTimes | None = None) -> Bubble:
    """The three bubbles of ``timeline`` (pass ``times`` to reuse a ``rank_times``)."""
    t = rank_times(timeline) if times is None else times
    total_idle = sum(t.idle)
    total_busy = sum(t.busy)
    capacity = timeline.num_ranks * timeline.makespan
    return Bubble(
        idle_fraction=total_idle / capacity if capacity > 0 else 0.0,
        over_ideal=total_idle / total_busy if total_busy > 0 else 0.0,
        per_rank_span_time=max(t.span_idle, default=0.0),
        per_rank_span_fraction=max(
            (idle / span for idle, span in zip(t.span_idle, t.span, strict=True) if span > 0),
            default=0.0,
        ),
        idle_time=max(t.idle, default=0.0),
    )


# ------------------------------------------------------------------------ memory
def _release_times(timeline: Timeline) -> dict[tuple[int, int], float]:
    """(stage, micro-batch) -> end of its last backward piece (B, or W after I)."""
    release: dict[tuple[int, int], float] = {}
    for e in timeline.events:
        a = e.action
        if a.kind in _BACKWARD_KINDS and a.microbatch is not None:
            key = (a.stage, a.microbatch)
            release[key] = max(release.get(key, e.end), e.end)
    return release


def _input_grads(timeline: Timeline) -> dict[tuple[int, int], tuple[float, float, int]]:
    """(stage, micro-batch) -> start and end of its I and the rank that runs it, where the
    backward is split."""
    spans: dict[tuple[int, int], tuple[float, float, int]] = {}
    for e in timeline.events:
        a = e.action
        if a.kind is Kind.I and a.microbatch is not None:
            spans[(a.stage, a.microbatch)] = (e.start, e.end, e.rank)
    return spans


def live_activations(
    timeline: Timeline,
    sizes: Sequence[float] | None = None,
    deferred: Sequence[float] | None = None,
    freed: Sequence[float] | None = None,
    sent: Sequence[float] | None = None,
    acks: Mapping[tuple[int, int], tuple[int, int, bool]] | None = None,
) -> tuple[tuple[tuple[float, float], ...], ...]:
    """Per rank, the step function of live activations as ``(time, amount)`` points.

    A micro-batch's activations on a stage are live from the start of its F until the end
    of its last backward piece. ``sizes[stage]`` weighs each stage (default 1: the unit is
    one stage's activations for one micro-batch). A forward with no backward in the
    timeline (an inference run, a truncated trace) stays live to the end.

    Where the backward is split: ``deferred[stage]`` is what it holds besides until the end
    of its W (the output gradients its weight products wait for), all of it from the end
    of its I and, within the I, what exceeds ``freed[stage]``: the part of
    ``sizes[stage]`` that the end of its I lets go (the saved tensors that are no linear's
    input, which W does not need).

    ``sent[stage]``: the input gradient each backward of the stage sends to another rank,
    held from the end of its B or I until ``acks`` says it has arrived: (stage, micro-batch)
    of the backward -> (stage, micro-batch, is a backward) of the action on the same rank
    whose incoming message proves it (``pipetrain.schedules.acks``), from that action's
    start; else to the end of the rank's step (docs/memory_model.md).
    """
    changes = _activation_changes(timeline, sizes, deferred, freed, sent, acks)
    return tuple(tuple(_levels(rank_changes)) for rank_changes in changes)


def _levels(changes: list[tuple[float, int, float]]) -> list[tuple[float, float]]:
    """(time, amount live after it) at each of one rank's (time, order, delta) changes."""
    level = 0.0
    points = []
    for time, _, delta in sorted(changes):
        level += delta
        points.append((time, level))
    return points


def _activation_changes(
    timeline: Timeline,
    sizes: Sequence[float] | None,
    deferred: Sequence[float] | None,
    freed: Sequence[float] | None,
    sent: Sequence[float] | None,
    acks: Mapping[tuple[int, int], tuple[int, int, bool]] | None,
) -> list[list[tuple[float, int, float]]]:
    """Per rank, ``live_activations``' changes as (time, order, delta)."""
    release = _release_times(timeline)
    spans = _input_grads(timeline) if deferred is not None or freed is not None else {}
    # Per rank: (time, order, delta). At equal times a release (order 0) comes before an
    # acquire (order 1): memory freed by a backward is reused by the next forward.
    changes: list[list[tuple[float, int, float]]] = [[] for _ in range(timeline.num_ranks)]
    for e in timeline.events:
        a = e.action
        if a.kind is not Kind.F or a.microbatch is None:
            continue
        amount = 1.0 if sizes is None else float(sizes[a.stage])
        changes[e.rank].append((e.start, 1, amount))
        end = release.get((a.stage, a.microbatch))
        if end is not None:
            changes[e.rank].append((end, 0, -amount))
    for (stage, mb), (start, end, rank) in spans.items():
        done = release[(stage, mb)]
        # What the end of the I lets go (the saved tensors no linear takes), moved from
        # the W's end rather than added.
        early = 0.0 if freed is None else float(freed[stage])
        # The I walks its layers backwards, each queueing its output gradients as it lets
        # go of its saved tensors: within the I only what it queues beyond what it frees
        # adds to the forward's activations; from its end, all of it.
        held = 0.0 if deferred is None else float(deferred[stage])
        excess = max(0.0, held - early)
        if excess:
            changes[rank].append((start, 1, excess))
        changes[rank].append((end, 0, held - excess - early))
        changes[rank].append((done, 0, early - held))
    if sent is not None:
        _add_sent_gradients(timeline, sent, acks or {}, changes)
    return changes


def peak_with_gradients(
    timeline: Timeline,
    gradients: Sequence[float],
    buckets: Sequence[float],
    sizes: Sequence[float] | None = None,
    deferred: Sequence[float] | None = None,
    freed: Sequence[float] | None = None,
    sent: Sequence[float] | None = None,
    acks: Mapping[tuple[int, int], tuple[int, int, bool]] | None = None,
) -> tuple[float, ...]:
    """Per rank, the most bytes of activations (``live_activations``, the same arguments)
    and weight gradients live at once. A stage's ``gradients[stage]`` (its ``.grad``
    tensors, set to None every step) count from the end of its first B or W on its rank,
    which makes them layer by layer as it lets go of the micro-batch's saved tensors, to
    the step's end; its ``buckets[stage]`` (the flat copies that the data-parallel
    all-reduce sums, 0 without replicas) from the end of its last."""
    changes = _activation_changes(timeline, sizes, deferred, freed, sent, acks)
    first: dict[int, tuple[float, int]] = {}
    last: dict[int, tuple[float, int]] = {}
    for e in timeline.events:
        stage = e.action.stage
        if e.action.kind not in (Kind.B, Kind.W):
            continue
        if stage not in first or e.end < first[stage][0]:
            first[stage] = (e.end, e.rank)
        if stage not in last or e.end > last[stage][0]:
            last[stage] = (e.end, e.rank)
    for stage, (end, rank) in first.items():
        changes[rank].append((end, 1, float(gradients[stage])))
    for stage, (end, rank) in last.items():
        changes[rank].append((end, 1, float(buckets[stage])))
    return tuple(max((lv for _, lv in _levels(c)), default=0.0) for c in changes)


def _add_sent_gradients(
    timeline: Timeline,
    sent: Sequence[float],
    acks: Mapping[tuple[int, int], tuple[int, int, bool]],
    changes: list[list[tuple[float, int, float]]],
) -> None:
    """Each B or I's sent input gradient, from its end until the action that proves it
    arrived starts, or to the end of its rank's step."""
    step_end = [0.0] * timeline.num_ranks
    starts: dict[tuple[int, int, bool], float] = {}
    for e in timeline.events:
        step_end[e.rank] = max(step_end[e.rank], e.end)
        a = e.action
        if a.microbatch is not None and a.kind in (Kind.F, Kind.B, Kind.I):
            starts.setdefault((a.stage, a.microbatch, a.kind is not Kind.F), e.start)
    for e in timeline.events:
        a = e.action
        if a.kind in (Kind.B, Kind.I) and a.microbatch is not None and sent[a.stage]:
            ack = acks.get((a.stage, a.microbatch))
            freed = step_end[e.rank] if ack is None else max(e.end, starts.get(ack, e.end))
            changes[e.rank].append((e.end, 1, float(sent[a.stage])))
            changes[e.rank].append((freed, 0, -float(sent[a.stage])))


def peak_activations(timeline: Timeline) -> tuple[int, ...]:
    """Per rank, the most stage-micro-batch activations live at once."""
    return tuple(
        round(max((level for _, level in curve), default=0.0))
        for curve in live_activations(timeline)
    )


def peak_activation_bytes(
    timeline: Timeline,
    sizes: Sequence[float],
    deferred: Sequence[float] | None = None,
    freed: Sequence[float] | None = None,
    sent: Sequence[float] | None = None,
    acks: Mapping[tuple[int, int], tuple[int, int, bool]] | None = None,
) -> tuple[float, ...]:
    """Per rank, the most activation bytes live at once; ``sizes[stage]`` is the bytes of
    one micro-batch's activations on each (virtual) stage, ``deferred[stage]`` what its
    split backward holds from I to W, ``freed[stage]`` what its I's end lets go,
    ``sent[stage]`` the input gradient its backward sends to another rank, held until
    ``acks`` (``live_activations``)."""
    return tuple(
        max((level for _, level in curve), default=0.0)
        for curve in live_activations(timeline, sizes, deferred, freed, sent, acks)
    )


def _stage_versions(events: Sequence[Event], release: dict[tuple[int, int], float]) -> int:
    """Most weight versions of one stage alive at once, from that stage's events.

    A STEP makes a new version current. A forward records the current version and its
    backward uses it, so a version stays alive while it is current or some micro-batch
    that used it has not finished its backward.
    """
    current = 0
    used_by: dict[int, int] = {}  # micro-batch -> version its forward used
    # (time, order, op, micro-batch): releases first at equal times, then steps, then
    # forwards, so a forward that starts as a step ends sees the new weights.
    ops: list[tuple[float, int, str, int]] = []
    for e in events:
        a = e.action
        mb = -1 if a.microbatch is None else a.microbatch
        if a.kind is Kind.F:
            ops.append((e.start, 2, "F", mb))
            if (a.stage, mb) in release:
                ops.append((release[(a.stage, mb)], 0, "done", mb))
        elif a.kind is Kind.STEP:
            ops.append((e.end, 1, "STEP", mb))
    peak = 1
    for _, _, op, mb in sorted(ops):
        if op == "F":
            used_by[mb] = current
        elif op == "done":
            used_by.pop(mb, None)
        else:
            current += 1
        peak = max(peak, len({current, *used_by.values()}))
    return peak


def stage_weight_versions(timeline: Timeline) -> dict[int, int]:
    """Stage -> the most weight versions of it alive at once."""
    release = _release_times(timeline)
    by_stage: dict[int, list[Event]] = {}
    for e in timeline.events:
        by_stage.setdefault(e.action.stage, []).append(e)
    return {stage: _stage_versions(events, release) for stage, events in by_stage.items()}


def weight_versions(timeline: Timeline) -> tuple[int, ...]:
    """Per rank, the most weight versions alive at once on any one of its stages.

    Synchronous schedules (no STEP actions) give 1 on every rank that has work, 0 on a
    rank with no events.
    """
    per_stage = stage_weight_versions(timeline)
    peaks = [0] * timeline.num_ranks
    for e in timeline.events:
        peaks[e.rank] = max(peaks[e.rank], per_stage[e.action.stage])
    return tuple(peaks)
