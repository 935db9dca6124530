"""Layer costs measured at several micro-batch sizes, and read at any size (torch-free).

A layer's time per call is not a straight line in the micro-batch size b: the per-call
part (kernel launches, Python dispatch) dominates at b = 1, and on a CPU a large b falls
out of the caches (measured on this machine, llama-default, one thread: 35.8, 30.3,
30.7, 28.7, 28.5 and 35.4 ms a sample at b = 1, 2, 4, 8, 16, 32; docs/plan_auto.md).
``CostCurve`` keeps the profile at each measured size and reads a size between two of them
on the straight line between their per-call times; beyond the largest (or below the
smallest) it extends the line of the nearest two. Its per-sample figures include the
per-call part, so a planner that reads them charges no separate fixed cost per layer.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from pipetrain.partition.balance import LayerCost
from pipetrain.partition.layer_costs import TIMES

__all__ = ["CostCurve"]


@dataclass(frozen=True)
class CostCurve:
    """Per-sample layer costs at each measured micro-batch size."""

    profiles: Mapping[int, Sequence[LayerCost]]

    def __post_init__(self) -> None:
        if not self.profiles:
            raise ValueError("a cost curve needs at least one measured micro-batch size")
        counts = {len(costs) for costs in self.profiles.values()}
        if len(counts) != 1:
            raise ValueError(f"profiles of different layer counts: {sorted(counts)}")

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.profiles))

    def at(self, size: int) -> list[LayerCost]:
        """Per-sample costs at micro-batch ``size`` (times per call interpolated)."""
        if size < 1:
            raise ValueError(f"micro-batch size must be >= 1, got {size}")
        if size in self.profiles:
            return list(self.profiles[size])
        sizes = self.sizes
        if len(sizes) == 1:
            return list(self.profiles[sizes[0]])
        i = bisect.bisect_left(sizes, size)
        lo, hi = (sizes[0], sizes[1]) if i == 0 else (sizes[-2], sizes[-1])
        if 0 < i < len(sizes):
            lo, hi = sizes[i - 1], sizes[i]
        weight = (size - lo) / (hi - lo)
        out = []
        for a, b in zip(self.profiles[lo], self.profiles[hi], strict=True):
            times = {}
            for name in TIMES:
                call_lo, call_hi = getattr(a, name) * lo, getattr(b, name) * hi
                call = call_lo + weight * (call_hi - call_lo)
                times[name] = max(0.0, call) / size
            # Saved bytes are linear in the size: the larger profile's per-sample figure.
            out.append(replace(b, **times))
        return out
