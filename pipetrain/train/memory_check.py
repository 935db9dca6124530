"""Predicted against measured peak memory per process, for the run summary.

Predicted: the planner's memory model in bytes (``pipetrain.partition.memory``, the formula
of docs/memory_model.md) for this run's schedule, split, micro-batches, dp, tp and
recomputation, from the model's sizes. Measured: on a CPU the process's peak resident
size over the steps less its resident size when the session was ready (data, tokenizer
and torch are not the model's) and less the library code paged in meanwhile (file-backed
pages), plus the weights that were resident already; on CUDA the
allocator's peak over the steps less what it held then, plus the weights. Runs that the
model does not describe (a schedule file, an asynchronous schedule, --shard, --ep,
--sequence-parallel, the single-process mode) report the measurement alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.config.schema import TrainConfig
from pipetrain.errors import InputError
from pipetrain.heap import running_allocator
from pipetrain.partition.balance import make_partition
from pipetrain.partition.estimate import DEFAULT_FLOPS, estimate_costs
from pipetrain.partition.layouts import AutoRequest, Hardware, Layout
from pipetrain.partition.scoring import Scorer
from pipetrain.partition.stages import stage_ranks_of
from pipetrain.schedules.registry import SCHEDULE_NAMES
from pipetrain.tensors import local_tensor
from pipetrain.train.metrics import peak_memory_bytes, reset_peak_memory

__all__ = ["MemoryCheck", "current_bytes", "memory_baseline", "predicted_bytes", "report_memory"]

# Only the bytes matter here; times just order the actions as the estimate would.
_ESTIMATE = Hardware("estimate", DEFAULT_FLOPS, 0.0, 0.0, 1e12, 1e12, 1e12)


def _status(field: str) -> int:
    """A byte count of /proc/self/status ("VmRSS:   325484 kB"); 0 where there is none."""
    try:
        status = Path("/proc/self/status").read_text(encoding="ascii")
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def current_bytes(device: torch.device) -> int:
    """What this process holds now that is not library code: on a CPU the resident set less
    its file-backed pages (torch's kernels page their code in on first use, tens of MB
    that are no model's), on CUDA the allocator's bytes."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return _status("VmRSS") - _status("RssFile")


def _peak_bytes(device: torch.device) -> int:
    """The peak since the baseline, less the library code paged in since (CPU)."""
    peak = peak_memory_bytes(str(device))
    return peak if device.type == "cuda" else peak - _status("RssFile")


def memory_baseline(device: torch.device) -> int:
    """This process's memory before the steps, with its peak restarted from there."""
    reset_peak_memory()
    return current_bytes(device)


def predicted_bytes(
    config: TrainConfig, model: Any, schedule: Any, split: Any
) -> tuple[float, ...]:
    """Per pipeline rank, the planner's bytes for one of its processes; () where the
    memory model does not describe the run."""
    p = config.pipeline
    if (
        p.schedule not in SCHEDULE_NAMES
        or schedule.asynchronous
        or p.shard
        or p.ep > 1
        or p.sequence_parallel
        or p.single_process
        or model.moe_blocks
    ):
        return ()
    seq_len, batch = config.data.seq_len, config.data.batch_size
    request = AutoRequest(p.processes, batch, seq_len)

    def costs_for(tp: int, mb: int) -> Any:
        return estimate_costs(model, seq_len, tp=tp)

    scorer = Scorer(model, request, costs_for, _ESTIMATE)
    some = tuple(sorted(p.recomputing_ranks)) if not p.recompute else ()
    layout = Layout(
        p.schedule, p.pp, p.dp, p.tp, p.chunks, p.microbatches, p.recompute, False,
        recompute_ranks=some, grad_views=p.grad_as_bucket_view,
    )  # fmt: skip
    costs = scorer.costs(p.tp, p.recompute, batch // p.dp // p.microbatches)
    bounds = [(stage[0], stage[-1] + 1) for stage in split]
    partition = make_partition("explicit", costs, bounds, stage_ranks_of(schedule.placement))
    scored = scorer.score(layout, schedule, partition, False)
    return tuple(m.total for m in scored.memory)


@dataclass(frozen=True)
class MemoryCheck:
    """Per process, in rank order: predicted and measured peak bytes."""

    predicted: tuple[float, ...]  # empty where not modelled
    measured: tuple[int, ...]
    allocator: str = ""
    """The C allocator of rank 0 on a CPU (``pipetrain.heap.running_allocator``): whose
    kept pages the resident set measures; "" on CUDA."""

    def to_json(self) -> dict[str, Any]:
        return {
            "memory_check": True,
            "predicted_peak": list(self.predicted),
            "measured_peak": list(self.measured),
            "allocator": self.allocator,
        }

    def format(self) -> str:
        measured = ", ".join(f"{b / 2**20:,.1f}" for b in self.measured)
        if self.allocator:
            measured += f" (C heap: {self.allocator})"
        if not self.predicted:
            return f"model memory per process (MiB): measured {measured}; predicted n/a"
        predicted = ", ".join(f"{b / 2**20:,.1f}" for b in self.predicted)
        worst = max(
            abs(m / p - 1) for m, p in zip(self.measured, self.predicted, strict=True) if p > 0
        )
        return (
            f"model memory per process (MiB): predicted {predicted}; measured {measured} "
            f"(off by {worst:.0%} at most)"
        )


def report_memory(session: Any) -> MemoryCheck:
    """Every process measures and gathers (a collective); rank 0 records and says it."""
    config, role, plan = session.config, session.role, session.plan
    weights = sum(local_tensor(t).numel() * t.element_size() for t in session.pipeline.parameters())
    mine = _peak_bytes(session.device) - session.memory_baseline + weights
    measured = [mine]
    if role.distributed:
        everyone: list[Any] = [None] * role.world_size
        dist.all_gather_object(everyone, mine)
        measured = [int(b) for b in everyone]
    try:
        per_pp = predicted_bytes(config, plan.model, plan.schedule, plan.split)
    except (InputError, ValueError):  # a layout the estimate refuses: measurement alone
        per_pp = ()
    group = config.pipeline.dp * config.pipeline.tp
    predicted = tuple(per_pp[r // group] for r in range(len(measured))) if per_pp else ()
    if predicted and any(not math.isfinite(b) for b in predicted):
        predicted = ()
    allocator = running_allocator() if session.device.type == "cpu" else ""
    check = MemoryCheck(predicted, tuple(measured), allocator)
    session.output.record(check.to_json())
    if role.reporter:
        session.output.say(check.format())
    return check
