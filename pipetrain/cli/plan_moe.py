"""``pipetrain plan`` for mixture-of-experts models: ``--ep`` and ``--ep-bandwidth``, their
checks, and what the plan says about the experts and their all-to-alls.

A MoE model's plan names its parameters, all and active per token; with ``--ep N`` every
per-rank figure is one rank of an expert-parallel group of N (``1 / N`` of the routed
experts; the group lies inside the data-parallel replicas, as ``pipetrain train --ep``),
and each pipeline rank's all-to-all bytes per step, and their time at ``--ep-bandwidth``
(``pipetrain.sim.expert_parallel``; the per-layer time is inside the stage times too).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipetrain.cli.errors import UsageError
from pipetrain.models.config import ModelConfig
from pipetrain.partition.balance import LayerCost, format_bytes
from pipetrain.partition.estimate import ModelCounts, check_expert_parallel, model_counts
from pipetrain.partition.planner import Plan
from pipetrain.sim.expert_parallel import ALLTOALLS_BACKWARD, ALLTOALLS_FORWARD, alltoall_bytes

__all__ = ["MoeReport", "add_ep_flags", "check_ep_args", "moe_report"]

_FP32 = 4  # bytes of one number of the tokens the all-to-alls carry, as the planner counts


def add_ep_flags(p: argparse.ArgumentParser) -> None:
    """Expert parallelism for MoE models: its degree and its link."""
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        metavar="N",
        help="expert-parallel ranks (MoE models, as train --ep): each rank holds 1/N of the "
        "routed experts of every MoE layer, tokens reach them by all-to-all; per-rank "
        "figures are one ep rank's (default 1)",
    )
    p.add_argument(
        "--ep-bandwidth",
        type=float,
        default=None,
        metavar="BYTES/S",
        help="bytes per second of a rank's expert-parallel link: the all-to-alls (2 per MoE "
        "block forward, 2 backward) add their time to the layers (default: bytes only, no time)",
    )


def check_ep_args(args: argparse.Namespace, config: ModelConfig) -> None:
    """One line for an ``--ep`` or ``--ep-bandwidth`` that does not fit the model or flags."""
    if args.ep < 1:
        raise UsageError(f"--ep must be >= 1, got {args.ep}")
    if args.ep_bandwidth is not None and not 0 < args.ep_bandwidth < math.inf:
        raise UsageError(f"--ep-bandwidth is {args.ep_bandwidth}: give a finite number > 0")
    if args.ep == 1 and args.ep_bandwidth is not None:
        raise UsageError(
            "--ep-bandwidth is for expert parallelism: add --ep 2 (or more), or drop it"
        )
    check_expert_parallel(config, args.ep)
    if args.ep > 1 and args.balance == "profile" and args.split is None:
        # The profile builds and times every expert of a layer, not an ep rank's share.
        raise UsageError(
            "--balance profile measures whole layers with all their experts, not an ep "
            "rank's share: use --balance uniform or params with --ep"
        )


@dataclass(frozen=True)
class MoeReport:
    """A MoE model's parameters and, per pipeline rank, what its expert-parallel
    all-to-alls send through one rank's link per step and how long they take."""

    counts: ModelCounts
    n_experts: int
    top_k: int
    expert_hidden: int
    n_shared: int
    ep: int
    bandwidth: float | None  # bytes/s; None: bytes only
    layer_bytes: float  # one rank, one MoE layer, one micro-batch, one all-to-all
    moe_layers_per_rank: tuple[int, ...]
    traffic_per_rank: tuple[float, ...]
    time_per_rank: tuple[float, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "params": self.counts.total,
            "active_params": self.counts.active,
            "moe_blocks": self.counts.moe_blocks,
            "n_experts": self.n_experts,
            "top_k": self.top_k,
            "ep": self.ep,
            "ep_bandwidth": self.bandwidth,
            "alltoall_bytes_per_layer": self.layer_bytes,
            "alltoalls_per_layer": ALLTOALLS_FORWARD + ALLTOALLS_BACKWARD,
            "moe_layers_per_rank": list(self.moe_layers_per_rank),
            "ep_traffic_per_rank": list(self.traffic_per_rank),
            "ep_time_per_rank": list(self.time_per_rank),
        }

    def lines(self) -> list[str]:
        c = self.counts
        shared = f" + {self.n_shared} shared" if self.n_shared else ""
        out = [
            f"mixture of experts: {c.moe_blocks} MoE blocks, {self.n_experts} experts of "
            f"{self.expert_hidden} hidden units{shared}, top-{self.top_k}; "
            f"{_count(c.total)} parameters, {_count(c.active)} active per token "
            f"(docs/memory_model.md)"
        ]
        if self.ep == 1:
            return out
        out += [
            f"expert parallel: ep {self.ep} inside the dp replicas (train --dp a multiple of "
            f"{self.ep}); a rank holds {self.n_experts // self.ep} of the {self.n_experts} "
            "experts of every MoE layer, the rest of the model whole; figures per ep rank",
            f"  per MoE layer and micro-batch: {ALLTOALLS_FORWARD} all-to-alls forward "
            f"(dispatch, combine) + {ALLTOALLS_BACKWARD} backward, each sending "
            f"{format_bytes(self.layer_bytes)} from every rank (dropless, balanced routing assumed)",
        ]
        for r, (layers, nbytes, secs) in enumerate(
            zip(self.moe_layers_per_rank, self.traffic_per_rank, self.time_per_rank, strict=True)
        ):
            took = f", {secs:.3f} s" if self.bandwidth else ""
            out.append(
                f"  rank {r}: {layers} MoE layers, all-to-alls send {format_bytes(nbytes)} per step{took}"
            )
        if not self.bandwidth:
            out.append("  (no --ep-bandwidth: the all-to-alls take no time in the step time)")
        return out


def moe_report(
    args: argparse.Namespace,
    config: ModelConfig,
    plan: Plan,
    costs: Sequence[LayerCost],
    seq_len: int,
) -> MoeReport | None:
    """The plan's MoE section (None for a dense model): the bytes each pipeline rank's
    MoE layers send by all-to-all per step, their share of micro-batches for replicas."""
    if not config.n_experts:
        return None
    names = {f"layers.{b}" for b in config.moe_blocks}
    tokens = plan.microbatch_size * seq_len
    sent = alltoall_bytes(tokens, config.top_k, config.d_model, args.ep, number_bytes=_FP32)
    per_layer_step = sent * (ALLTOALLS_FORWARD + ALLTOALLS_BACKWARD)
    layers, traffic = [0] * plan.pp, [0.0] * plan.pp
    for stage in plan.stages:
        moe = sum(1 for i in stage.layers if costs[i].name in names)
        for rank in stage.ranks:  # a replica runs its share of the micro-batches
            layers[rank] += moe
            traffic[rank] += moe * per_layer_step * plan.microbatches / len(stage.ranks)
    time = [t / args.ep_bandwidth if args.ep_bandwidth else 0.0 for t in traffic]
    return MoeReport(
        model_counts(config),
        config.n_experts,
        config.top_k,
        config.expert_hidden,
        config.n_shared_experts,
        args.ep,
        args.ep_bandwidth,
        sent,
        tuple(layers),
        tuple(traffic),
        tuple(time),
    )


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)
