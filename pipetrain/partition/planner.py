"""A pipeline plan: the split for a schedule, its memory per rank, and the micro-batch choice.

Torch-free: it takes per-layer costs (estimated or measured) and a function that builds the
schedule for a number of micro-batches, and asks the simulator for step times and peak
live activations. The micro-batch advice follows what one would do by hand: memory per
sample from the costs, minus parameters, gradients and optimizer state, gives the largest
micro-batch that fits the limit under the schedule's peak of live activations; then the
candidate micro-batch counts are ranked by simulated step time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pipetrain.partition.balance import (
    LayerCost,
    MemoryModel,
    Partition,
    PartitionError,
)
from pipetrain.partition.limits import check_fits, max_microbatch, rank_limits
from pipetrain.partition.split_sim import simulate_split
from pipetrain.partition.stages import (
    model_stage_live,
    model_stage_versions,
    rank_live_points,
    split_for,
    stage_ranks_of,
)
from pipetrain.schedules.schedule import Schedule, ScheduleError
from pipetrain.sim.ranks import slowdowns
from pipetrain.sim.simulator import SimResult

__all__ = [
    "MicrobatchOption",
    "Overheads",
    "Plan",
    "ScheduleFactory",
    "StagePlan",
    "make_plan",
]

ScheduleFactory = Callable[[int], Schedule]  # micro-batches -> the schedule to plan for


@dataclass(frozen=True)
class Overheads:
    """What does not scale with the micro-batch size; without it smaller is always faster.

    ``per_layer``: seconds each layer adds to every F, I and W (twice to a B): kernel
    launches and Python dispatch. Messages between ranks take ``latency`` plus their bytes
    (``message_bytes_per_sample`` times the micro-batch size) over ``bandwidth`` (bytes/s).
    """

    per_layer: float = 0.0
    latency: float = 0.0
    bandwidth: float | None = None
    message_bytes_per_sample: float = 0.0


@dataclass(frozen=True)
class StagePlan:
    """One model stage. Times are seconds per micro-batch; bytes per micro-batch."""

    stage: int
    ranks: tuple[int, ...]  # one rank, or one per replica
    layers: tuple[int, ...]
    first: str
    last: str
    blocks: tuple[int, ...]  # among the transformer blocks, 0-based
    embedding: bool
    head: bool
    params: int
    forward: float
    backward: float
    activation_bytes: float  # one micro-batch's activations on this stage
    live: int  # the schedule's peak of live micro-batches on this stage

    @property
    def peak_activation_bytes(self) -> float:
        return self.activation_bytes * self.live


@dataclass(frozen=True)
class MicrobatchOption:
    microbatches: int
    microbatch_size: int
    step_time: float  # simulated seconds per optimizer step
    peak_bytes: float  # the fullest rank: parameters, gradients, optimizer state, activations
    fits: bool


@dataclass(frozen=True)
class Plan:
    schedule: str
    pp: int
    batch_size: int
    microbatches: int
    time_source: str  # how the times were obtained, printed with them
    partition: Partition
    stages: tuple[StagePlan, ...]
    rank_time: tuple[float, ...]  # compute per step
    # Parameters (every weight version held) + gradients + optimizer state.
    rank_static_bytes: tuple[float, ...]
    rank_peak_activation_bytes: tuple[float, ...]
    step_time: float
    memory_limit: float | None
    max_microbatch_size: int | None  # the largest that fits the limit (None: no limit)
    options: tuple[MicrobatchOption, ...]
    # Unequal ranks (None: all alike): each rank's speed (its times are the costs' divided
    # by it) and its own memory limit (instead of ``memory_limit``).
    rank_speed: tuple[float, ...] | None = None
    rank_memory: tuple[float, ...] | None = None

    @property
    def limits(self) -> tuple[float, ...] | None:
        """Each rank's memory limit, or None without one."""
        if self.rank_memory is not None:
            return self.rank_memory
        return None if self.memory_limit is None else (self.memory_limit,) * self.pp

    @property
    def microbatch_size(self) -> int:
        return self.batch_size // self.microbatches

    @property
    def imbalance(self) -> float:
        """Slowest stage time over the mean stage time, per micro-batch (1.0 = even)."""
        times = [s.forward + s.backward for s in self.stages]
        mean = sum(times) / len(times)
        return max(times) / mean if mean > 0 else 1.0

    @property
    def rank_bytes(self) -> tuple[float, ...]:
        return tuple(
            s + a
            for s, a in zip(self.rank_static_bytes, self.rank_peak_activation_bytes, strict=True)
        )

    @property
    def recommended(self) -> MicrobatchOption | None:
        fitting = [o for o in self.options if o.fits]
        return min(fitting, key=lambda o: (o.step_time, o.microbatches)) if fitting else None

    def to_json(self) -> dict[str, Any]:
        best = self.recommended
        return {
            "schedule": self.schedule,
            "pp": self.pp,
            "method": self.partition.method,
            "time_source": self.time_source,
            "batch_size": self.batch_size,
            "microbatches": self.microbatches,
            "microbatch_size": self.microbatch_size,
            "stages": [
                {
                    "stage": s.stage,
                    "rank": s.ranks[0],
                    "ranks": list(s.ranks),
                    "layers": list(s.layers),
                    "first": s.first,
                    "last": s.last,
                    "blocks": list(s.blocks),
                    "embedding": s.embedding,
                    "head": s.head,
                    "params": s.params,
                    "forward": s.forward,
                    "backward": s.backward,
                    "time": s.forward + s.backward,
                    "activation_bytes": s.activation_bytes,
                    "live_microbatches": s.live,
                    "peak_activation_bytes": s.peak_activation_bytes,
                }
                for s in self.stages
            ],
            "ranks": [
                {
                    "rank": r,
                    "time": self.rank_time[r],
                    "static_bytes": self.rank_static_bytes[r],
                    "peak_activation_bytes": self.rank_peak_activation_bytes[r],
                    "peak_bytes": self.rank_bytes[r],
                }
                for r in range(self.pp)
            ],
            "imbalance": self.imbalance,
            "step_time": self.step_time,
            "memory_limit": self.memory_limit,
            "max_microbatch_size": self.max_microbatch_size,
            "options": [
                {
                    "microbatches": o.microbatches,
                    "microbatch_size": o.microbatch_size,
                    "step_time": o.step_time,
                    "peak_bytes": o.peak_bytes,
                    "fits": o.fits,
                }
                for o in self.options
            ],
            "recommended": None
            if best is None
            else {"microbatches": best.microbatches, "microbatch_size": best.microbatch_size},
            **({} if self.rank_speed is None else {"rank_speed": list(self.rank_speed)}),
            **({} if self.rank_memory is None else {"rank_memory": list(self.rank_memory)}),
        }


def _sim(
    schedule: Schedule,
    partition: Partition,
    mb: int,
    overheads: Overheads,
    batch_scale: int,
    speeds: Sequence[float] | None = None,
) -> SimResult:
    return simulate_split(
        schedule,
        partition,
        mb,
        per_layer=overheads.per_layer,
        latency=overheads.latency,
        bandwidth=overheads.bandwidth,
        message_bytes=overheads.message_bytes_per_sample * mb,
        batch_scale=batch_scale,
        speeds=speeds,
    )


def _static_bytes(partition: Partition, state_factor: float, sim: SimResult) -> tuple[float, ...]:
    """Per rank: gradients and optimizer state of its stages, plus every weight version it
    holds (one for synchronous schedules; PipeDream keeps stashed versions)."""
    totals = list(sim.weight_bytes or (0.0,) * partition.num_ranks)
    for stage, ranks in enumerate(partition.stage_ranks):
        for rank in ranks:
            totals[rank] += (state_factor - 1) * partition.param_bytes[stage]
    return tuple(totals)


def make_plan(
    costs: Sequence[LayerCost],
    *,
    schedule_for: ScheduleFactory,
    batch_size: int,
    microbatches: int,
    method: str = "uniform",
    split: Sequence[int] | None = None,
    memory_limit: float | None = None,
    state_factor: float = 4.0,
    time_source: str = "estimated",
    overheads: Overheads = Overheads(),
    whole_batch: bool = False,
    rank_speed: Sequence[float] | None = None,
    rank_memory: Sequence[float] | None = None,
) -> Plan:
    """Split ``costs`` for the schedule at ``microbatches`` and rank the micro-batch counts.

    ``whole_batch``: the schedule does not micro-batch (naive model parallel); each of its
    actions carries all ``microbatches`` micro-batches. ``rank_speed`` and ``rank_memory``
    (one per rank) describe unequal ranks: a rank's times are divided by its speed, and
    its own memory limit replaces ``memory_limit``; the balanced splits follow both.
    """
    if batch_size < 1 or microbatches < 1 or batch_size % microbatches:
        raise PartitionError(
            f"--batch-size {batch_size} is not a whole number of --microbatches {microbatches}: "
            "pick a micro-batch count that divides the batch size"
        )
    schedule = schedule_for(microbatches)
    mb = batch_size // microbatches
    speeds = None if rank_speed is None else tuple(rank_speed)
    limits = rank_limits(memory_limit, rank_memory, schedule.num_ranks)
    live, memory = _memory_model(
        schedule,
        mb,
        microbatches,
        limits,
        state_factor,
        whole_batch=whole_batch,
        per_rank=rank_memory is not None,
    )
    partition = split_for(method, costs, stage_ranks_of(schedule.placement), split, memory, speeds)
    sim = _sim(schedule, partition, mb, overheads, microbatches if whole_batch else 1, speeds)
    static = _static_bytes(partition, state_factor, sim)
    peaks = sim.peak_activation_bytes or tuple(0.0 for _ in static)
    if limits is not None:
        check_fits(static, peaks, limits, partition.method, whole_batch=whole_batch)
    stages = _stage_plans(costs, partition, mb, overheads, live, speeds)
    return Plan(
        schedule=schedule.name,
        pp=schedule.num_ranks,
        batch_size=batch_size,
        microbatches=microbatches,
        time_source=time_source,
        partition=partition,
        stages=stages,
        rank_time=_rank_time(stages, schedule.num_ranks, microbatches),
        rank_static_bytes=static,
        rank_peak_activation_bytes=peaks,
        step_time=sim.makespan,
        memory_limit=memory_limit,
        max_microbatch_size=max_microbatch(static, peaks, mb, limits),
        options=_options(
            schedule_for,
            partition,
            batch_size,
            state_factor,
            limits,
            overheads,
            whole_batch,
            speeds,
        ),
        rank_speed=speeds,
        rank_memory=None if rank_memory is None else tuple(rank_memory),
    )


def _memory_model(
    schedule: Schedule,
    mb: int,
    microbatches: int,
    limits: tuple[float, ...] | None,
    state_factor: float,
    *,
    whole_batch: bool,
    per_rank: bool = False,
) -> tuple[tuple[int, ...], MemoryModel | None]:
    """Peak live micro-batches per model stage, and the memory model of a limit (None
    without one); ``mb``: samples per micro-batch."""
    live = model_stage_live(schedule)
    points = rank_live_points(schedule)
    if whole_batch:
        # Each action carries every micro-batch: a stage holds all of their activations.
        live = tuple(n * microbatches for n in live)
        points = tuple(tuple(tuple(n * microbatches for n in p) for p in r) for r in points)
    if limits is None:
        return live, None
    memory = MemoryModel(
        max(limits),
        mb,
        live,
        state_factor,
        model_stage_versions(schedule),
        points,
        whole_batch,
        # Each rank's own (``--rank-memory``): errors then name that flag.
        limits if per_rank else (),
    )
    return live, memory


def _stage_plans(
    costs: Sequence[LayerCost],
    partition: Partition,
    mb: int,
    overheads: Overheads,
    live: Sequence[int],
    speeds: Sequence[float] | None = None,
) -> tuple[StagePlan, ...]:
    """Each stage's layers and its costs for one micro-batch of ``mb`` samples, on its
    rank (divided by that rank's speed)."""
    slow = slowdowns(partition.stage_ranks, speeds)
    return tuple(
        StagePlan(
            stage=s,
            ranks=partition.stage_ranks[s],
            layers=layers,
            first=costs[layers[0]].name,
            last=costs[layers[-1]].name,
            blocks=partition.blocks(costs, s),
            embedding=any(costs[i].kind == "embedding" for i in layers),
            head=any(costs[i].kind == "head" for i in layers),
            params=partition.params[s],
            forward=(partition.forward[s] * mb + overheads.per_layer * len(layers)) * slow[s],
            backward=(partition.backward[s] * mb + 2 * overheads.per_layer * len(layers)) * slow[s],
            activation_bytes=partition.activation_bytes_per_sample[s] * mb,
            live=live[s],
        )
        for s, layers in enumerate(partition.stages)
    )


def _rank_time(stages: Sequence[StagePlan], num_ranks: int, microbatches: int) -> tuple[float, ...]:
    """Compute per step on each rank; a replica of a stage does its share of the micro-batches."""
    totals = [0.0] * num_ranks
    for s in stages:
        for rank in s.ranks:
            totals[rank] += (s.forward + s.backward) * microbatches / len(s.ranks)
    return tuple(totals)


def _options(
    schedule_for: ScheduleFactory,
    partition: Partition,
    batch_size: int,
    state_factor: float,
    limits: Sequence[float] | None,
    overheads: Overheads,
    whole_batch: bool,
    speeds: Sequence[float] | None = None,
) -> tuple[MicrobatchOption, ...]:
    options = []
    for m in range(1, batch_size + 1):
        if batch_size % m:
            continue
        try:
            schedule = schedule_for(m)
        except ScheduleError:
            continue  # this schedule does not run with m micro-batches (e.g. 1F1B needs m >= p)
        mb = batch_size // m
        sim = _sim(schedule, partition, mb, overheads, m if whole_batch else 1, speeds)
        static = _static_bytes(partition, state_factor, sim)
        peaks = sim.peak_activation_bytes or tuple(0.0 for _ in static)
        held = [s + a for s, a in zip(static, peaks, strict=True)]
        fits = limits is None or all(h <= lim for h, lim in zip(held, limits, strict=True))
        options.append(MicrobatchOption(m, mb, sim.makespan, max(held), fits))
    return tuple(options)
