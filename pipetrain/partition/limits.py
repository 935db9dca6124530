"""Memory limits per rank: each rank's limit, whether a split's peaks fit, and the
largest micro-batch that does (torch-free; the planner's arithmetic).

One limit for every rank (``--memory-limit``) or one per rank (``--rank-memory``, for a
pipeline over devices of different memory): both come out as a tuple, one per rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pipetrain.partition.balance import PartitionError, format_bytes

__all__ = ["check_fits", "max_microbatch", "rank_limits"]


def rank_limits(
    memory_limit: float | None, rank_memory: Sequence[float] | None, num_ranks: int
) -> tuple[float, ...] | None:
    """Each rank's memory limit: its own, else the common one; None without either."""
    if rank_memory is not None:
        if len(rank_memory) != num_ranks:
            raise PartitionError(
                f"--rank-memory gives {len(rank_memory)} sizes for {num_ranks} ranks: give one "
                "per pipeline rank"
            )
        return tuple(rank_memory)
    return None if memory_limit is None else (memory_limit,) * num_ranks


def check_fits(
    static: Sequence[float],
    peaks: Sequence[float],
    limits: Sequence[float],
    method: str,
    *,
    whole_batch: bool,
) -> None:
    """Refuse a split whose simulated peak on some rank is over its memory limit."""
    over = [r for r in range(len(static)) if static[r] + peaks[r] > limits[r]]
    if over:
        r = over[0]
        raise PartitionError(
            f"rank {r} needs {format_bytes(static[r] + peaks[r])} with this {method} "
            f"split, over its memory limit of {format_bytes(limits[r])}: use "
            "--balance params or profile, more ranks (--pp, --tp), "
            f"{'a smaller --batch-size' if whole_batch else 'more micro-batches'}, or a higher "
            "--memory-limit (or --rank-memory)"
        )


def max_microbatch(
    static: Sequence[float], peaks: Sequence[float], mb: int, limits: Sequence[float] | None
) -> int | None:
    """Activations grow with the micro-batch size; the static part does not."""
    if limits is None:
        return None
    best = math.inf
    for fixed, activations, limit in zip(static, peaks, limits, strict=True):
        per_sample = activations / mb
        if per_sample > 0:
            best = min(best, (limit - fixed) / per_sample)
    return None if best == math.inf else max(0, math.floor(best))
