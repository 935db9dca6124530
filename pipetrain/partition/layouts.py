"""The space ``plan --auto`` searches: a layout's fields, the request and hardware it is
searched for, and a scored layout (torch-free; ``pipetrain.partition.auto`` searches)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pipetrain.models.config import ModelConfig
from pipetrain.partition.balance import LayerCost, PartitionError
from pipetrain.partition.estimate import check_tensor_parallel
from pipetrain.partition.memory import RankMemory
from pipetrain.schedules.registry import SCHEDULE_NAMES, get_spec

__all__ = [
    "AutoPlan",
    "AutoRequest",
    "CostsFor",
    "Hardware",
    "Layout",
    "Scored",
    "enumerate_layouts",
]

# (tp degree, micro-batch size) -> one tp rank's per-sample layer costs at that size.
CostsFor = Callable[[int, int], Sequence[LayerCost]]


@dataclass(frozen=True)
class Hardware:
    """What a device and its links do; estimated times divide FLOPs by ``flops``."""

    name: str
    flops: float  # sustained FLOP/s of one process
    per_layer: float  # seconds each layer adds to every F, I and W (twice to a B)
    latency: float  # seconds per pipeline message
    link_bandwidth: float  # bytes/s between pipeline ranks and of the dp all-reduce
    tp_bandwidth: float  # bytes/s of a tensor-parallel link
    update_bandwidth: float  # bytes/s the optimizer update streams its state through
    # Measured all-reduces, (group size, seconds per call, bytes/s in ring terms: a ring
    # all-reduce of n bytes over g ranks takes latency + 2 (g - 1) / g * n / bandwidth);
    # () = link_bandwidth (dp) and tp_bandwidth (tp) without latency.
    allreduce: tuple[tuple[int, float, float], ...] = ()
    # False where the processes share the cores that compute (a CPU): a collective then
    # runs on the cores the backward needs and hides behind nothing.
    overlap_comm: bool = True
    # What a step holds beyond the model's count, measured by the profile (fit_overhead):
    # a fraction of the activations and bytes per process; (0, 0) unmeasured.
    memory_overhead: tuple[float, float] = (0.0, 0.0)
    # The same for layouts that recompute every block (of their saved and recomputed bytes).
    recompute_overhead: tuple[float, float] = (0.0, 0.0)
    # Cores that all the processes share (a CPU; their costs measured with every process
    # busy at once); 0 = a device per process. sim/shared_cores.py: a bubble frees cores.
    shared_cores: float = 0.0
    # Seconds each action (an F, B, I or W of one stage) costs beyond its layers: the
    # executor, autograd's entry and, where processes share cores, the switch between
    # them. 0 unmeasured; the calibration's pipelined reference fits it (plan_calibrate).
    per_action: float = 0.0

    def allreduce_link(self, group: int, tp: bool = False) -> tuple[float, float]:
        """(latency, ring bandwidth) of an all-reduce over ``group`` ranks: the measured
        group size nearest below it (the largest measured beyond), else the preset."""
        if not self.allreduce:
            return 0.0, self.tp_bandwidth if tp else self.link_bandwidth
        measured = sorted(self.allreduce)
        below = [m for m in measured if m[0] <= group] or measured[:1]
        _, latency, bandwidth = below[-1]
        return latency, bandwidth


@dataclass(frozen=True)
class AutoRequest:
    """The space to search and the budget."""

    world_size: int
    batch_size: int
    seq_len: int
    memory_limit: float | None = None  # bytes per process; None: no limit
    schedules: tuple[str, ...] = ()  # () = every synchronous built-in schedule
    chunks: tuple[int, ...] = (2, 4)  # stages per rank tried by looped schedules
    max_tp: int = 8  # a tp group lives inside one machine's fast links
    recompute: tuple[bool, ...] = (False, True)
    top: int = 5  # candidates kept exact and shown
    # Layouts whose schedule has more than this many forwards (p x m x v) are not simulated:
    # a replay of 64 x 64 takes seconds. Pruning: docs/plan_auto.md.
    max_forwards: int = 1024
    # Where dp > 1, score the .grad tensors as views of the buckets too
    # (pipeline.grad_as_bucket_view) and keep them unless the fullest process holds more.
    grad_views: bool = False


@dataclass(frozen=True, order=True)
class Layout:
    """One point of the space: what a ``pipetrain train`` config sets."""

    schedule: str
    pp: int
    dp: int
    tp: int
    chunks: int
    microbatches: int
    recompute: bool
    early_grads: bool
    # Expert-parallel ranks (MoE models), inside dp as pipeline.ep: each holds 1/ep of the
    # routed experts of every MoE layer.
    ep: int = 1
    # Only these pipeline ranks recompute (pipeline.recompute_ranks; recompute is False).
    recompute_ranks: tuple[int, ...] = ()
    # The .grad tensors are views of persistent dp buckets (pipeline.grad_as_bucket_view).
    grad_views: bool = False

    def describe(self) -> str:
        v = f" v={self.chunks}" if get_spec(self.schedule).uses_chunks else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        some = ",".join(map(str, self.recompute_ranks))
        extras = "".join(
            (
                " recompute" if self.recompute else "",
                f" recompute-ranks={some}" if some else "",
                " early-grads" if self.early_grads else "",
                " grad-views" if self.grad_views else "",
            )
        )
        return (
            f"{self.schedule}{v} pp={self.pp} dp={self.dp} tp={self.tp}{ep} "
            f"m={self.microbatches}" + extras
        )


@dataclass(frozen=True)
class Scored:
    """A simulated layout: its split, step time and bytes per rank."""

    layout: Layout
    split: tuple[int, ...]  # blocks per model stage (pipeline.split)
    memory_balanced: bool  # the time-balanced split did not fit: balanced under the limit
    pipeline_time: float  # the simulator's makespan of one step
    dp_time: float  # the dp all-reduce's time after the last backward
    update_time: float  # the optimizer update
    bubble: float  # idle share of the pipeline
    memory: tuple[RankMemory, ...]
    fits: bool
    tokens: int  # per step, every replica's

    @property
    def step_time(self) -> float:
        return self.pipeline_time + self.dp_time + self.update_time

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_time if self.step_time > 0 else math.inf

    @property
    def peak_bytes(self) -> float:
        return max(m.total for m in self.memory)

    @property
    def peak_rank(self) -> int:
        totals = [m.total for m in self.memory]
        return totals.index(max(totals))

    def to_json(self) -> dict[str, Any]:
        """The layout's fields, its split and predictions; bytes per pipeline rank by kind."""
        return {
            "layout": dataclasses.asdict(self.layout),
            "describe": self.layout.describe(),
            "split": list(self.split),
            "memory_balanced": self.memory_balanced,
            "step_time_s": self.step_time,
            "pipeline_time_s": self.pipeline_time,
            "dp_time_s": self.dp_time,
            "update_time_s": self.update_time,
            "tokens_per_s": self.tokens_per_s,
            "bubble": self.bubble,
            "peak_bytes": self.peak_bytes,
            "peak_rank": self.peak_rank,
            "fits": self.fits,
            "memory": [dataclasses.asdict(m) | {"total": m.total} for m in self.memory],
        }


@dataclass(frozen=True)
class AutoPlan:
    """The search's outcome: fitting layouts fastest first, and how much it looked at."""

    request: AutoRequest
    ranked: tuple[Scored, ...]  # fitting, fastest first
    over_budget: tuple[Scored, ...]  # simulated but over the limit, fastest first
    layouts: int  # in the space
    simulated: int
    pruned: int  # never simulated: their bound could not beat the top
    seconds: float

    @property
    def winner(self) -> Scored | None:
        return self.ranked[0] if self.ranked else None

    def to_json(self) -> dict[str, Any]:
        """The request, the ``top`` fastest that fit, what the limit gave up, the counts."""
        req, given = self.request, self.given_up
        return {
            "world_size": req.world_size,
            "batch_size": req.batch_size,
            "seq_len": req.seq_len,
            "memory_limit": req.memory_limit,
            "ranked": [s.to_json() for s in self.ranked[: req.top]],
            "given_up": given.to_json() if given is not None else None,
            "layouts": self.layouts,
            "simulated": self.simulated,
            "pruned": self.pruned,
            "seconds": self.seconds,
        }

    @property
    def given_up(self) -> Scored | None:
        """The fastest layout the memory limit ruled out, when it beats the winner."""
        best = self.over_budget[0] if self.over_budget else None
        win = self.winner
        if best is None or (win is not None and best.step_time >= win.step_time):
            return None
        return best


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _synchronous(names: Sequence[str]) -> tuple[str, ...]:
    return tuple(n for n in (names or SCHEDULE_NAMES) if not get_spec(n).asynchronous)


def enumerate_layouts(config: ModelConfig, req: AutoRequest) -> Iterator[Layout]:
    """Every layout of the space that the schedules' own constraints accept."""
    for tp in _divisors(req.world_size):
        if tp > req.max_tp:
            continue
        try:
            check_tensor_parallel(config, tp, seq_len=req.seq_len)
        except PartitionError:
            continue
        for pp in _divisors(req.world_size // tp):
            dp = req.world_size // (tp * pp)
            if req.batch_size % dp:
                continue
            # One rank: every schedule is the same gradient accumulation.
            names = ("1f1b",) if pp == 1 else _synchronous(req.schedules)
            for name in names:
                spec = get_spec(name)
                for v in req.chunks if spec.uses_chunks else (spec.default_chunks,):
                    stages = pp * v if spec.placement != "chimera" else pp
                    if stages > config.n_layers + 2:
                        continue
                    for m in _divisors(req.batch_size // dp):
                        if pp * m * v > req.max_forwards or spec.check(pp, m, v) is not None:
                            continue
                        for recompute in req.recompute:
                            for ep in _expert_degrees(config, dp):
                                yield Layout(name, pp, dp, tp, v, m, recompute, False, ep)


def _expert_degrees(config: ModelConfig, dp: int) -> list[int]:
    """The ep degrees of a dp: those dividing it and the experts (1 for a dense model)."""
    if not config.n_experts:
        return [1]
    return [e for e in _divisors(dp) if config.n_experts % e == 0]
