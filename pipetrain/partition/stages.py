"""What a schedule means for the stages of a split (torch-free).

Which ranks hold each model stage (one, or one per replica), how many micro-batches each
stage keeps alive at its peak, and the split itself for a placement, for the trainer and
runtime that only need the layer ranges.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pipetrain.models.config import ModelConfig
from pipetrain.partition.balance import (
    LayerCost,
    MemoryModel,
    Partition,
    PartitionError,
    parse_split,
    split_by_cost,
    split_by_params,
    split_explicit,
    split_uniform,
)
from pipetrain.partition.estimate import estimate_costs
from pipetrain.schedules.actions import Kind
from pipetrain.schedules.placement import Placement
from pipetrain.schedules.schedule import Schedule
from pipetrain.sim.metrics import stage_weight_versions
from pipetrain.sim.simulator import simulate

__all__ = [
    "model_stage_live",
    "model_stage_versions",
    "rank_live_points",
    "split_for",
    "split_layers",
    "stage_live_peaks",
    "stage_ranks_of",
]


def stage_live_peaks(schedule: Schedule) -> tuple[int, ...]:
    """Per virtual stage, the most micro-batches whose activations are held at once.

    A micro-batch's activations on a stage live from its F to its B (or to its W when the
    backward is split: W still needs the saved inputs). One rank runs its actions in
    order, so the count follows the order alone, whatever the timing.
    """
    peaks = [0] * schedule.placement.num_stages
    live = [0] * schedule.placement.num_stages
    for rank_actions in schedule.actions:
        for action in rank_actions:
            if action.kind is Kind.F:
                live[action.stage] += 1
                peaks[action.stage] = max(peaks[action.stage], live[action.stage])
            elif action.kind in (Kind.B, Kind.W):  # an I frees nothing: its W needs the inputs
                live[action.stage] -= 1
    return tuple(peaks)


def model_stage_live(schedule: Schedule) -> tuple[int, ...]:
    """Per model stage, the peak live micro-batches of its busiest replica."""
    per_virtual = stage_live_peaks(schedule)
    placement = schedule.placement
    return tuple(
        max(per_virtual[v] for v in placement.replicas_of(j))
        for j in range(placement.num_model_stages)
    )


def rank_live_points(schedule: Schedule) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per rank, its live micro-batches per model stage after each of its forwards.

    A rank's activations can only peak right after a forward, and one point with at least
    as many of every stage as another makes the other redundant: those are dropped. The
    counts follow the rank's order of actions, as in ``stage_live_peaks``.
    """
    placement = schedule.placement
    out = []
    for rank_actions in schedule.actions:
        live = [0] * placement.num_model_stages
        seen: set[tuple[int, ...]] = set()
        for action in rank_actions:
            if action.kind is Kind.F:
                live[placement.model_stage(action.stage)] += 1
                seen.add(tuple(live))
            elif action.kind in (Kind.B, Kind.W):
                live[placement.model_stage(action.stage)] -= 1
        out.append(
            tuple(
                sorted(
                    p
                    for p in seen
                    if not any(
                        q != p and all(a >= b for a, b in zip(q, p, strict=True)) for q in seen
                    )
                )
            )
        )
    return tuple(out)


def model_stage_versions(schedule: Schedule) -> tuple[int, ...]:
    """Per model stage, the most weight versions its busiest replica holds at once.

    One for synchronous schedules; PipeDream keeps a version per micro-batch in flight. The
    count follows the order of the actions (a STEP ends a version, a backward releases the
    one its forward used), so unit costs give it for any costs.
    """
    per_virtual = stage_weight_versions(simulate(schedule).timeline)
    placement = schedule.placement
    return tuple(
        max(per_virtual.get(v, 1) for v in placement.replicas_of(j))
        for j in range(placement.num_model_stages)
    )


def split_for(
    method: str,
    costs: Sequence[LayerCost],
    stage_ranks: tuple[tuple[int, ...], ...],
    split: Sequence[int] | None,
    memory: MemoryModel | None,
    speeds: Sequence[float] | None = None,
) -> Partition:
    """The partition by ``split`` (blocks per stage) if given, else by ``method``; balanced
    by time, a stage on a rank of speed 0.5 (``speeds[rank]``) counts twice its time."""
    if split is not None:
        return split_explicit(costs, split, stage_ranks)
    if method == "uniform":
        return split_uniform(costs, stage_ranks)
    if method == "params":
        return split_by_params(costs, stage_ranks, memory)
    if method in ("profile", "cost"):
        # Balanced by time; the name says where the times came from.
        return replace(split_by_cost(costs, stage_ranks, memory, speeds), method=method)
    raise PartitionError(f"--balance {method!r} is unknown: use one of uniform, params, profile")


def stage_ranks_of(placement: Placement) -> tuple[tuple[int, ...], ...]:
    """Model stage -> the ranks holding it (one per replica), from a schedule's placement."""
    return tuple(
        tuple(placement.rank_of(v) for v in placement.replicas_of(j))
        for j in range(placement.num_model_stages)
    )


def split_layers(
    config: ModelConfig,
    placement: Placement,
    *,
    split: str | Sequence[int] | None = None,
    method: str = "uniform",
    seq_len: int | None = None,
) -> tuple[tuple[int, ...], ...]:
    """Global layer indices of each model stage of ``placement``, without measuring anything.

    ``split``: blocks per stage (``"4,3,5"``); else ``method`` "uniform" or "params" (with
    estimated costs, "profile" falls back to FLOP estimates here). The trainer and runtime
    feed the result to ``build_stage``.
    """
    costs = estimate_costs(config, seq_len or config.max_seq_len)
    counts = parse_split(split) if isinstance(split, str) else split
    name = "cost" if method == "profile" else method
    return split_for(name, costs, stage_ranks_of(placement), counts, None).stages
