"""The text ``pipetrain plan`` prints: the stages, the ranks, the micro-batch advice."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipetrain.cli.plan_moe import MoeReport
from pipetrain.partition.planner import Plan

__all__ = ["TpReport", "render"]


@dataclass(frozen=True)
class TpReport:
    """Tensor parallelism inside the stages: its degree, and per pipeline rank what its tp
    collectives move through one tp rank's link per step and how long they take."""

    tp: int
    sequence_parallel: bool
    bandwidth: float | None  # bytes/s; None: bytes only
    traffic_per_rank: tuple[float, ...]
    time_per_rank: tuple[float, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "tp": self.tp,
            "sequence_parallel": self.sequence_parallel,
            "tp_bandwidth": self.bandwidth,
            "tp_traffic_per_rank": list(self.traffic_per_rank),
            "tp_time_per_rank": list(self.time_per_rank),
        }

    def lines(self, pp: int) -> list[str]:
        if self.tp == 1:
            return []
        sp = ", sequence parallel" if self.sequence_parallel else ""
        out = [
            f"tensor parallel: tp {self.tp}{sp}; {pp} x {self.tp} = {pp * self.tp} processes; "
            f"every figure per rank is one tp rank's (docs/memory_model.md)"
        ]
        for r, (nbytes, secs) in enumerate(
            zip(self.traffic_per_rank, self.time_per_rank, strict=True)
        ):
            took = f", {secs:.3f} s" if self.bandwidth else ""
            out.append(f"  rank {r}: tp collectives move {_bytes(nbytes)} per step{took}")
        if not self.bandwidth:
            out.append("  (no --tp-bandwidth: the tp collectives take no time in the step time)")
        return out


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def render(
    plan: Plan,
    model: str,
    seq_len: int,
    tp: TpReport | None = None,
    moe: MoeReport | None = None,
) -> str:
    """The plan as tables for a terminal."""
    lines = [
        f"{model}: {plan.schedule} on {plan.pp} ranks, {plan.partition.num_stages} stages "
        f"({plan.partition.method} split), batch {plan.batch_size} x {seq_len} tokens in "
        f"{plan.microbatches} micro-batches of {plan.microbatch_size}",
        f"times: {plan.time_source}; per micro-batch",
        *(tp.lines(plan.pp) if tp is not None else []),
        *(moe.lines() if moe is not None else []),
        "",
        f"{'stage':>5} {'rank':>5}  {'layers':<24} {'params':>8} {'fwd ms':>9} {'bwd ms':>9} "
        f"{'act/mb':>10} {'live':>4} {'peak act':>10}",
    ]
    for s in plan.stages:
        ranks = ",".join(map(str, s.ranks))
        span = s.first if s.first == s.last else f"{s.first} .. {s.last}"
        lines.append(
            f"{s.stage:>5} {ranks:>5}  {span:<24} {_count(s.params):>8} {_ms(s.forward):>9} "
            f"{_ms(s.backward):>9} {_bytes(s.activation_bytes):>10} {s.live:>4} "
            f"{_bytes(s.peak_activation_bytes):>10}"
        )
    lines += [
        "",
        f"{'rank':>5} {'compute/step s':>15} {'params+grads+adamw':>19} {'peak activations':>17} {'total':>10}",
    ]
    for r in range(plan.pp):
        lines.append(
            f"{r:>5} {plan.rank_time[r]:>15.3f} {_bytes(plan.rank_static_bytes[r]):>19} "
            f"{_bytes(plan.rank_peak_activation_bytes[r]):>17} {_bytes(plan.rank_bytes[r]):>10}"
        )
    lines += [
        "",
        f"imbalance (slowest stage / mean): {plan.imbalance:.3f}",
        f"simulated step time: {plan.step_time:.3f} s",
    ]
    if plan.memory_limit is not None:
        fit = plan.max_microbatch_size
        lines.append(
            f"memory limit {_bytes(plan.memory_limit)} per rank: largest micro-batch that fits: "
            f"{fit if fit else 'none'}"
        )
    lines.append(
        "micro-batch counts by simulated step time (compute linear in the micro-batch size plus "
        "the fixed part per layer and action, and --latency-ms per message):"
    )
    for o in sorted(plan.options, key=lambda o: o.step_time):
        note = "" if o.fits else "  (over the memory limit)"
        lines.append(
            f"  m={o.microbatches:<4} micro-batch {o.microbatch_size:<4} {o.step_time:>8.3f} s  "
            f"peak {_bytes(o.peak_bytes)}{note}"
        )
    best = plan.recommended
    lines.append(
        "recommended: none fits the memory limit"
        if best is None
        else f"recommended: --microbatches {best.microbatches} (micro-batch size {best.microbatch_size})"
    )
    return "\n".join(lines) + "\n"
