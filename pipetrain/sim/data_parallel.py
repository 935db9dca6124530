"""The data-parallel gradient all-reduce on top of a pipeline timeline (pp x dp).

With ``dp`` replicas of the pipeline, every rank all-reduces the gradients of each of its
stages with that stage's replicas once per step. As the runtime does
(``pipetrain.parallel.mesh``), a stage's all-reduce starts when its last B or W of the
step ends, and a rank's all-reduces run one after another on its link, in the order the
stages became ready. A ring all-reduce of ``n`` bytes over ``d`` replicas moves
``2 (d - 1) / d * n`` bytes through every member's link. The step ends when the
pipeline and every all-reduce are done; what sticks out past the pipeline is exposed::

    rank 0  F0 F1 B0 B1 |ar s0.....|          ar = all-reduce of a stage's gradients
    rank 1     F0 B0 F1 B1 |ar s1..| ....     rank 1's starts during rank 0's cool-down
            ^ pipeline makespan       ^ step time; exposed = step time - makespan

Sharded (``--shard``, FSDP2 per stage; ``sharded_cost``): a replica holds 1/d of each
stage's parameters, so every step all-gathers them and reduce-scatters the gradients
instead; each moves (d - 1) / d of the stage's bytes through every member's link, the
pair as much as one all-reduce. As the runtime does (``pipetrain.parallel.sharded``), all of
a rank's gathers are issued at the start of the step, one after another on its link in
the order of the stages' first F, and a stage's first F cannot start before its gather
has ended: the schedule is replayed again with those F held back, so a gather that ends
while the rank still waits for its first activation (ranks > 0) costs nothing, and one
that delays an F delays whatever depends on it. The reduce-scatters then follow on the
same link as the stages' last B or W end::

    rank 0  |ag|F0 F1 B0 B1 |rs|              ag = all-gather of the stage's parameters
    rank 1  |ag|   F0 B0 F1 B1 |rs|           rank 1's gather hides under its wait for F0
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pipetrain.errors import InputError
from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.execution import Costs, Timeline, replay
from pipetrain.schedules.placement import Placement
from pipetrain.schedules.schedule import Schedule

__all__ = [
    "DataParallelCost",
    "DataParallelError",
    "LinkSpan",
    "ShardedCost",
    "data_parallel_cost",
    "ring_allreduce_time",
    "ring_gather_time",
    "sharded_cost",
]


class DataParallelError(InputError):
    """Replica counts, bandwidths or byte sizes that make no sense."""


def _ring_time(nbytes: float, replicas: int, bandwidth: float, passes: int) -> float:
    if replicas < 1:
        raise DataParallelError(f"replicas is {replicas}: use 1 or more (--dp)")
    if replicas == 1 or nbytes <= 0:
        return 0.0
    if not bandwidth > 0:
        raise DataParallelError(
            f"bandwidth is {bandwidth}: give a positive number of bytes per time unit "
            "(--dp-bandwidth)"
        )
    return passes * (replicas - 1) / replicas * nbytes / bandwidth


def ring_allreduce_time(nbytes: float, replicas: int, bandwidth: float) -> float:
    """Time of a ring all-reduce of ``nbytes`` over ``replicas`` at ``bandwidth`` bytes/unit.

    Each member sends and receives 2 (n - 1) / n of the buffer (reduce-scatter, then
    all-gather); latency is left out.
    """
    return _ring_time(nbytes, replicas, bandwidth, 2)


def ring_gather_time(nbytes: float, replicas: int, bandwidth: float) -> float:
    """Time of a ring all-gather into (or reduce-scatter out of) ``nbytes`` over ``replicas``.

    Each member sends and receives (n - 1) / n of the full buffer: half an all-reduce.
    """
    return _ring_time(nbytes, replicas, bandwidth, 1)


@dataclass(frozen=True)
class LinkSpan:
    """One collective on a rank's data-parallel link, in the pipeline timeline's time
    (what ``pipetrain simulate --trace`` shows)."""

    rank: int
    name: str
    start: float
    end: float


@dataclass(frozen=True)
class DataParallelCost:
    """The dp all-reduce of one step, per pipeline rank (tuples are indexed by rank)."""

    replicas: int
    # Gradient bytes each rank all-reduces per step (its stages' parameters).
    bytes_per_rank: tuple[float, ...]
    # Bytes that cross each rank's link per step: 2 (d - 1) / d of the above.
    traffic_per_rank: tuple[float, ...]
    # Time each rank spends in all-reduces (0 when no bandwidth was given).
    allreduce_time: tuple[float, ...]
    # When each rank's last all-reduce ends.
    finish: tuple[float, ...]
    pipeline_makespan: float
    # Each all-reduce that takes time, when it runs.
    spans: tuple[LinkSpan, ...] = ()

    @property
    def step_time(self) -> float:
        return max((self.pipeline_makespan, *self.finish))

    @property
    def exposed(self) -> float:
        """All-reduce time the pipeline could not hide."""
        return self.step_time - self.pipeline_makespan

    def to_json(self) -> dict[str, Any]:
        return {
            "dp": self.replicas,
            "bytes_per_rank": list(self.bytes_per_rank),
            "traffic_per_rank": list(self.traffic_per_rank),
            "allreduce_time": list(self.allreduce_time),
            "step_time": self.step_time,
            "exposed": self.exposed,
        }


def _per_stage(stage_bytes: float | Sequence[float], num_model_stages: int) -> tuple[float, ...]:
    if isinstance(stage_bytes, (int, float)):
        values = (float(stage_bytes),) * num_model_stages
    else:
        values = tuple(float(b) for b in stage_bytes)
    if len(values) != num_model_stages:
        raise DataParallelError(
            f"{len(values)} gradient sizes for {num_model_stages} model stages: give one per "
            f"model stage, or one number for all"
        )
    if any(b < 0 for b in values):
        raise DataParallelError("gradient bytes must be 0 or more")
    return values


def data_parallel_cost(
    timeline: Timeline,
    placement: Placement,
    stage_bytes: float | Sequence[float],
    *,
    replicas: int,
    bandwidth: float | None = None,
) -> DataParallelCost:
    """The all-reduce of every rank's stages after ``timeline`` (one step of a pipeline).

    ``stage_bytes``: gradient bytes of each model stage (one number: every stage).
    ``bandwidth``: bytes per time unit of a rank's link; None counts bytes only.
    """
    sizes = _per_stage(stage_bytes, placement.num_model_stages)
    ready: dict[int, float] = {}
    start = min((e.start for e in timeline.events), default=0.0)
    for event in timeline.events:
        if event.action.kind in (Kind.B, Kind.W):
            stage = event.action.stage
            ready[stage] = max(ready.get(stage, start), event.end)
    makespan = timeline.makespan
    totals, traffic, times, finishes = [], [], [], []
    spans: list[LinkSpan] = []
    for rank in range(timeline.num_ranks):
        stages = sorted(placement.stages_of(rank), key=lambda s: (ready.get(s, start), s))
        clock = start
        total = busy = 0.0
        for stage in stages:
            nbytes = sizes[placement.model_stage(stage)]
            total += nbytes
            took = (
                ring_allreduce_time(nbytes, replicas, bandwidth) if bandwidth is not None else 0.0
            )
            begin = max(clock, ready.get(stage, start))
            clock = begin + took
            busy += took
            if took > 0:
                spans.append(LinkSpan(rank, f"all-reduce stage {stage}", begin, clock))
        totals.append(total)
        traffic.append(2.0 * (replicas - 1) / replicas * total if replicas > 1 else 0.0)
        times.append(busy)
        finishes.append(clock - start)
    return DataParallelCost(
        replicas,
        tuple(totals),
        tuple(traffic),
        tuple(times),
        tuple(finishes),
        makespan,
        tuple(spans),
    )


@dataclass(frozen=True)
class ShardedCost:
    """The sharded (FSDP) traffic of one step, per pipeline rank (tuples indexed by rank)."""

    replicas: int
    # Unsharded parameter bytes of each rank's stages: what it all-gathers per step, and
    # as gradients what it reduce-scatters.
    bytes_per_rank: tuple[float, ...]
    # Bytes through each rank's link for the gathers, and for the reduce-scatters:
    # (d - 1) / d of the above each.
    gather_traffic_per_rank: tuple[float, ...]
    reduce_scatter_traffic_per_rank: tuple[float, ...]
    # Time each rank's link spends in them (0 when no bandwidth was given).
    gather_time: tuple[float, ...]
    reduce_scatter_time: tuple[float, ...]
    # When each rank's last reduce-scatter ends.
    finish: tuple[float, ...]
    # The pipeline alone, and with every stage's first F held back until its gather ends.
    pipeline_makespan: float
    gathered_makespan: float
    # Each gather and reduce-scatter that takes time, in the time of ``timeline``: the
    # replay with every first F held back until its gather ends.
    spans: tuple[LinkSpan, ...] = ()
    timeline: Timeline | None = None

    @property
    def traffic_per_rank(self) -> tuple[float, ...]:
        return tuple(
            g + r
            for g, r in zip(
                self.gather_traffic_per_rank, self.reduce_scatter_traffic_per_rank, strict=True
            )
        )

    @property
    def step_time(self) -> float:
        return max((self.gathered_makespan, *self.finish))

    @property
    def gather_delay(self) -> float:
        """How much later the pipeline ends because first forwards waited for gathers."""
        return self.gathered_makespan - self.pipeline_makespan

    @property
    def exposed(self) -> float:
        """Gather and reduce-scatter time the pipeline could not hide."""
        return self.step_time - self.pipeline_makespan

    def to_json(self) -> dict[str, Any]:
        return {
            "dp": self.replicas,
            "sharded": True,
            "bytes_per_rank": list(self.bytes_per_rank),
            "traffic_per_rank": list(self.traffic_per_rank),
            "all_gather_traffic_per_rank": list(self.gather_traffic_per_rank),
            "reduce_scatter_traffic_per_rank": list(self.reduce_scatter_traffic_per_rank),
            "all_gather_time": list(self.gather_time),
            "reduce_scatter_time": list(self.reduce_scatter_time),
            "gather_delay": self.gather_delay,
            "step_time": self.step_time,
            "exposed": self.exposed,
        }


def _first_forwards(schedule: Schedule) -> dict[int, Action]:
    """Each stage's first F in its rank's program: the one its all-gather must precede."""
    first: dict[int, Action] = {}
    for row in schedule.actions:
        for action in row:
            if action.kind is Kind.F:
                first.setdefault(action.stage, action)
    return first


def sharded_cost(
    schedule: Schedule,
    costs: Costs,
    stage_bytes: float | Sequence[float],
    *,
    replicas: int,
    bandwidth: float | None = None,
) -> ShardedCost:
    """All-gathers and reduce-scatters of every rank's sharded stages in one step of
    ``schedule`` under ``costs`` (see the module docstring for the model).

    ``stage_bytes``: parameter bytes of each model stage (one number: every stage).
    ``bandwidth``: bytes per time unit of a rank's link; None counts bytes only.
    """
    _check_shardable(schedule, replicas)
    placement = schedule.placement
    sizes = _per_stage(stage_bytes, placement.num_model_stages)

    def took(stage: int) -> float:
        nbytes = sizes[placement.model_stage(stage)]
        return ring_gather_time(nbytes, replicas, bandwidth) if bandwidth is not None else 0.0

    gathers = _gathers(schedule, took)
    # Both replays start at 0, with the gathers; the held one may start later on every
    # rank, so its length is measured from 0 rather than from its first event.
    plain = replay(schedule, costs)
    held = replay(schedule, costs, not_before=gathers.gathered) if any(gathers.ends) else plain
    held_end = max((e.end for e in held.events), default=0.0)
    ready: dict[int, float] = {}
    for event in held.events:
        if event.action.kind in (Kind.B, Kind.W):
            ready[event.action.stage] = max(ready.get(event.action.stage, 0.0), event.end)
    spans = list(gathers.spans)
    totals, scatter_times, finishes = [], [], []
    for rank, stages in enumerate(gathers.rank_stages):
        clock = gathers.ends[rank]
        busy = 0.0
        for stage in sorted(stages, key=lambda s: (ready.get(s, 0.0), s)):
            begin = max(clock, ready.get(stage, 0.0))
            clock = begin + took(stage)
            busy += took(stage)
            if took(stage) > 0:
                spans.append(LinkSpan(rank, f"reduce-scatter stage {stage}", begin, clock))
        totals.append(sum(sizes[placement.model_stage(s)] for s in stages))
        scatter_times.append(busy)
        finishes.append(clock)
    share = (replicas - 1) / replicas
    traffic = tuple(share * t for t in totals)
    return ShardedCost(
        replicas,
        tuple(totals),
        traffic,
        traffic,
        gathers.ends,
        tuple(scatter_times),
        tuple(finishes),
        plain.makespan,
        held_end,
        tuple(spans),
        held,
    )


def _check_shardable(schedule: Schedule, replicas: int) -> None:
    # The runtime refuses the same two (pipetrain.train.plan.check_shardable).
    why = (
        "is asynchronous (weights change inside a step)"
        if schedule.asynchronous
        else "replicates stages inside the pipeline"
        if schedule.placement.replicas > 1
        else None
    )
    if why is not None:
        raise DataParallelError(
            f"sharded stages do not fit {schedule.name!r}, which {why}: pick a synchronous "
            "schedule such as 1f1b or zb-h1, or drop --shard"
        )
    if replicas < 1:
        raise DataParallelError(f"replicas is {replicas}: use 1 or more (--dp)")


@dataclass(frozen=True)
class _Gathers:
    """Each rank's all-gathers at the start of a step, back to back on its link."""

    rank_stages: tuple[list[int], ...]  # per rank, its stages in gathering order
    ends: tuple[float, ...]  # per rank, when its last gather ends
    gathered: dict[Action, float]  # a stage's first F -> when that stage's gather ends
    spans: tuple[LinkSpan, ...]


def _gathers(schedule: Schedule, took: Callable[[int], float]) -> _Gathers:
    """The gathers of every rank, in the order the runtime issues them: by first F in
    the rank's program; ``took(stage)``: one gather's time."""
    placement = schedule.placement
    first_f = _first_forwards(schedule)
    position = {a: pos for row in schedule.actions for pos, a in enumerate(row)}

    def gather_order(stage: int) -> tuple[int, int]:
        return (0, position[first_f[stage]]) if stage in first_f else (1, stage)

    gathered: dict[Action, float] = {}
    ends, rank_stages = [], []
    spans: list[LinkSpan] = []
    for rank in range(len(schedule.actions)):
        stages = sorted(placement.stages_of(rank), key=gather_order)
        clock = 0.0
        for stage in stages:
            if took(stage) > 0:
                spans.append(
                    LinkSpan(rank, f"all-gather stage {stage}", clock, clock + took(stage))
                )
            clock += took(stage)
            if stage in first_f:
                gathered[first_f[stage]] = clock
        ends.append(clock)
        rank_stages.append(stages)
    return _Gathers(tuple(rank_stages), tuple(ends), gathered, tuple(spans))
