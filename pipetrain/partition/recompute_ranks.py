"""Recomputation on some pipeline ranks only (``pipeline.recompute_ranks``), for the
planner: the split that balances it and the stage sums it runs (torch-free).

In 1F1B-like schedules the first ranks hold the most micro-batches, so under a memory
budget they may be the only ones that need to recompute. A recomputing rank runs each
block's forward again in its backward: balanced by time, it should get fewer blocks. The
balancer already weighs a stage by its rank's speed (``split_for``'s ``speeds``, for
unequal devices); a recomputing rank is given the speed its blocks lose to recomputation.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace

from pipetrain.partition.balance import LayerCost, Partition, make_partition

__all__ = ["recompute_speeds", "recomputed_on"]


def recompute_speeds(
    plain: Sequence[LayerCost],
    again: Sequence[LayerCost],
    ranks: Collection[int],
    num_ranks: int,
) -> list[float]:
    """Per rank, 1, or for a rank in ``ranks`` its blocks' time without recomputation
    (``plain``) over their time with it (``again``)."""
    blocks = [i for i, c in enumerate(plain) if c.kind == "block"]
    without = sum(plain[i].time for i in blocks)
    with_it = sum(again[i].time for i in blocks)
    speed = without / with_it if with_it > 0 else 1.0
    return [speed if r in ranks else 1.0 for r in range(num_ranks)]


def recomputed_on(
    partition: Partition, again: Sequence[LayerCost], ranks: Collection[int]
) -> Partition:
    """``partition`` with the stages held by ``ranks`` summed from the recomputed costs
    ``again`` (their backward runs their forward again; they keep their blocks' inputs
    only); the other stages as they were."""
    bounds = [(stage[0], stage[-1] + 1) for stage in partition.stages]
    other = make_partition(partition.method, again, bounds, partition.stage_ranks)
    pick = [any(r in ranks for r in holders) for holders in partition.stage_ranks]

    def mixed(field: str) -> tuple[float, ...]:
        values = zip(getattr(partition, field), getattr(other, field), pick, strict=True)
        return tuple(b if use else a for a, b, use in values)

    return replace(
        partition,
        forward=mixed("forward"),
        backward=mixed("backward"),
        backward_input=mixed("backward_input"),
        backward_weight=mixed("backward_weight"),
        activation_bytes_per_sample=mixed("activation_bytes_per_sample"),
        freed_at_input_bytes_per_sample=mixed("freed_at_input_bytes_per_sample"),
    )
