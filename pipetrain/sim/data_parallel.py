"""The data-parallel gradient all-reduce on top of a pipeline timeline (pp x dp).

With ``dp`` replicas of the pipeline, every rank all-reduces the gradients of each of its
stages with that stage's replicas once per step. As the runtime does
(``pipetrain.train.parallel``), a stage's all-reduce starts when its last B or W of the
step ends, and a rank's all-reduces run one after another on its link, in the order the
stages became ready. A ring all-reduce of ``n`` bytes over ``d`` replicas moves
``2 (d - 1) / d * n`` bytes through every member's link. The step ends when the
pipeline and every all-reduce are done; what sticks out past the pipeline is exposed::

    rank 0  F0 F1 B0 B1 |ar s0.....|          ar = all-reduce of a stage's gradients
    rank 1     F0 B0 F1 B1 |ar s1..| ....     rank 1's starts during rank 0's cool-down
            ^ pipeline makespan       ^ step time; exposed = step time - makespan
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipetrain.errors import InputError
from pipetrain.schedules.actions import Kind
from pipetrain.schedules.execution import Timeline
from pipetrain.schedules.placement import Placement

__all__ = ["DataParallelCost", "DataParallelError", "data_parallel_cost", "ring_allreduce_time"]


class DataParallelError(InputError):
    """Replica counts, bandwidths or byte sizes that make no sense."""


def ring_allreduce_time(nbytes: float, replicas: int, bandwidth: float) -> float:
    """Time of a ring all-reduce of ``nbytes`` over ``replicas`` at ``bandwidth`` bytes/unit.

    Each member sends and receives 2 (n - 1) / n of the buffer (reduce-scatter, then
    all-gather); latency is left out.
    """
    if replicas < 1:
        raise DataParallelError(f"replicas is {replicas}: use 1 or more (--dp)")
    if replicas == 1 or nbytes <= 0:
        return 0.0
    if not bandwidth > 0:
        raise DataParallelError(
            f"bandwidth is {bandwidth}: give a positive number of bytes per time unit"
        )
    return 2.0 * (replicas - 1) / replicas * nbytes / bandwidth


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
    for rank in range(timeline.num_ranks):
        stages = sorted(placement.stages_of(rank), key=lambda s: (ready.get(s, start), s))
        clock = start
        total = busy = 0.0
        for stage in stages:
            nbytes = sizes[placement.model_stage(stage)]
            total += nbytes
            took = ring_allreduce_time(nbytes, replicas, bandwidth) if bandwidth else 0.0
            clock = max(clock, ready.get(stage, start)) + took
            busy += took
        totals.append(total)
        traffic.append(2.0 * (replicas - 1) / replicas * total if replicas > 1 else 0.0)
        times.append(busy)
        finishes.append(clock - start)
    return DataParallelCost(
        replicas, tuple(totals), tuple(traffic), tuple(times), tuple(finishes), makespan
    )
