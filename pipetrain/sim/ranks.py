"""Unequal ranks: a pipeline over devices of different speeds (torch-free).

A rank's speed is relative to the device the costs describe: 1 runs them as given, 0.5
takes twice as long (an older GPU, a shared CPU). Costs are per model stage, so a stage
held by several ranks (Chimera's replicas) runs at its slowest holder's speed: the
replicas of a stage meet at its gradient all-reduce, so the slower one sets the pace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pipetrain.errors import InputError
from pipetrain.schedules.execution import Costs
from pipetrain.schedules.placement import Placement

__all__ = ["RankSpeedError", "check_speeds", "slowdowns", "with_rank_speeds"]

_COMPUTE = ("forward", "backward", "backward_input", "backward_weight")


class RankSpeedError(InputError):
    """Speeds that are not one positive number per rank."""


def check_speeds(speeds: Sequence[float], num_ranks: int) -> None:
    """Raise ``RankSpeedError`` unless ``speeds`` is one finite number > 0 per rank."""
    shown = ",".join(f"{s:g}" for s in speeds)
    if len(speeds) != num_ranks:
        raise RankSpeedError(
            f"--rank-speed {shown} gives {len(speeds)} speeds for {num_ranks} ranks: give one "
            "per pipeline rank, e.g. 1,1,0.5,1"
        )
    if not all(0 < s < float("inf") for s in speeds):
        raise RankSpeedError(
            f"--rank-speed {shown}: every speed must be a number > 0 (1 = the costs as given, "
            "0.5 = twice as slow)"
        )


def slowdowns(holders: Sequence[Sequence[int]], speeds: Sequence[float] | None) -> list[float]:
    """Per stage, what its times are multiplied by: 1 / the speed of its slowest holder
    (``holders[stage]``: the ranks that hold it). All 1 without ``speeds``."""
    if speeds is None:
        return [1.0] * len(holders)
    check_speeds(speeds, max(max(ranks) for ranks in holders) + 1)
    return [1.0 / min(speeds[r] for r in ranks) for ranks in holders]


def with_rank_speeds(costs: Costs, placement: Placement, speeds: Sequence[float]) -> Costs:
    """``costs`` (per model stage, or one for all) with each model stage's F, B, I and W
    divided by the speed of its slowest rank; messages and step-level costs unchanged."""
    check_speeds(speeds, placement.num_ranks)
    holders = [
        [placement.rank_of(v) for v in placement.replicas_of(j)]
        for j in range(placement.num_model_stages)
    ]
    factor = slowdowns(holders, speeds)
    costs.check(placement.num_model_stages)
    fields: dict[str, Any] = {}
    for name in _COMPUTE:
        value = getattr(costs, name)
        per_stage = value if isinstance(value, tuple) else (float(value),) * len(factor)
        fields[name] = tuple(v * k for v, k in zip(per_stage, factor, strict=True))
    return replace(costs, **fields)
