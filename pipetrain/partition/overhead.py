"""Separate what a layer costs per sample from what it costs per call (torch-free).

A layer measured at two micro-batch sizes, b1 < b2, gives two times t1 and t2 per call. With
t(b) = fixed + b * per_sample: per_sample = (t2 - t1) / (b2 - b1), fixed = t1 - b1 * per_sample.
The fixed part (kernel launches, Python dispatch, small-matrix inefficiency) is what makes
tiny micro-batches slow; without it the simulator would always prefer the smallest one.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipetrain.partition.balance import LayerCost

__all__ = ["FixedSplit", "remove_fixed_cost", "split_fixed_cost"]


@dataclass(frozen=True)
class FixedSplit:
    """Per-sample costs with the fixed part removed, and the fixed seconds per layer and action."""

    costs: tuple[LayerCost, ...]
    per_layer: float


def split_fixed_cost(
    small: Sequence[LayerCost], small_size: int, large: Sequence[LayerCost], large_size: int
) -> FixedSplit:
    """Fit t(b) = fixed + b * per_sample per layer from two profiles of the same model.

    The fixed part is the median over layers of the forward's intercept (clipped at 0: noise
    on a shared machine can make it negative), charged once per F, I and W and twice per B,
    as the planner's ``Overheads`` does. ``large``'s per-sample costs lose that fixed part
    (kept >= 0, and B = I + W).
    """
    if large_size <= small_size:
        raise ValueError(f"need two sizes with large > small, got {small_size} and {large_size}")
    intercepts = []
    for s, g in zip(small, large, strict=True):
        t1, t2 = s.forward * small_size, g.forward * large_size
        slope = (t2 - t1) / (large_size - small_size)
        intercepts.append(t1 - small_size * slope)
    fixed = max(0.0, statistics.median(intercepts))
    return FixedSplit(remove_fixed_cost(large, large_size, fixed), fixed)


def remove_fixed_cost(
    measured: Sequence[LayerCost], size: int, fixed: float
) -> tuple[LayerCost, ...]:
    """Per-sample costs measured at micro-batch ``size`` less ``fixed`` seconds per call.

    The planner charges the fixed part per layer and action on its own (``Overheads``):
    left in the measured figures it would count twice, and ``size`` times over at larger
    micro-batches. Each figure stays >= 0, and B = I + W.
    """

    def without_fixed(per_sample: float) -> float:
        return max(0.0, (per_sample * size - fixed) / size)

    costs = []
    for g in measured:
        if g.backward_input > 0:
            b_in, b_w = without_fixed(g.backward_input), without_fixed(g.backward_weight)
        else:  # no input gradient (the embedding): the whole backward is the weight part
            b_in, b_w = 0.0, without_fixed(g.backward)
        costs.append(
            replace(
                g,
                forward=without_fixed(g.forward),
                backward=b_in + b_w,
                backward_input=b_in,
                backward_weight=b_w,
            )
        )
    return tuple(costs)
