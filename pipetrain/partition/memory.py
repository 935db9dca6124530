"""The planner's memory model in bytes, per rank, for one candidate layout (torch-free).

What one process (one tp rank of one pipeline rank of one replica) holds at its peak:

    weights + gradients + optimizer state   16 bytes a parameter (fp32 AdamW), plus the
                                            dp gradient buckets (4 more) with dp > 1 (or
                                            the flat copies Chimera's replicas sum)
    activations                             the simulator's peak over the schedule of the
                                            live micro-batches' saved tensors
    transient                               with recomputation, the one block being re-run
                                            in the backward holds its full activations
    in backward                             the running backward's gradients beside the
                                            saved tensors (``partition.workspace``)
    buffers                                 messages in flight: a receive posted ahead from
                                            each neighbour and an activation sent forward
                                            (the gradients sent back are the simulator's)

The per-layer figures and the formula term by term are docs/memory_model.md; the schedule
decides the activations (``pipetrain.sim.simulator`` counts them per rank).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from pipetrain.partition.balance import LayerCost, Partition

__all__ = [
    "OPTIMIZER_FACTOR",
    "RankMemory",
    "fit_line",
    "fit_overhead",
    "gradient_copies",
    "rank_memory",
    "recompute_costs",
]

# AdamW keeps two fp32 moments per parameter.
OPTIMIZER_FACTOR = 2


@dataclass(frozen=True)
class RankMemory:
    """Bytes one process holds at its peak, by what holds them."""

    weights: float  # every weight version held (one for synchronous schedules)
    # The .grad tensors, plus the flat copies that are all-reduced where there is a sum:
    # dp > 1, or replicas of a stage (Chimera: ``dp`` is then the all-reduce group's size).
    gradients: float
    optimizer: float
    activations: float  # the schedule's peak of live micro-batches' saved tensors
    transient: float  # recomputation: one block's full activations for one micro-batch
    buffers: float  # pipeline messages in flight
    # Measured on this machine where profiled (``fit_overhead``), else 0: what a step holds
    # beyond the saved tensors (the backward's gradients in flight, the optimizer's
    # temporaries, the allocator's slack) and the process's own (communicators, caches).
    workspace: float = 0.0
    # What the workspace's fraction is of: one action's activations on the rank's largest
    # stage, plus the recomputed block's (``rank_memory``); a calibration refits on it.
    in_flight: float = 0.0
    # What the running backward holds beside the saved tensors on the rank's largest
    # layer kind (``partition.workspace``: its gradients before it frees any).
    in_backward: float = 0.0
    # What of the gradients the peak does not meet, where the simulated timeline says
    # (``rank_memory``'s ``peak_with_gradients``): the .grad tensors are made at a stage's
    # first backward and the dp buckets after its last, so a peak at the end of the
    # forwards holds neither.
    unmet: float = 0.0

    @property
    def static(self) -> float:
        """What does not depend on the micro-batches: weights, gradients, optimizer state."""
        return self.weights + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        return (
            self.static + self.activations + self.transient + self.in_backward + self.buffers
            + self.workspace - self.unmet
        )  # fmt: skip


def _unmet(
    activations: Sequence[float],
    gradients: float,
    joint: Sequence[float] | None,
    rank: int,
    held: float = 0.0,
) -> float:
    """What of ``rank``'s ``gradients`` (with the buckets) the ``joint`` peak of both with
    the activations leaves out; 0 where there is no joint peak. ``held``: gradients held
    all step, which ``joint`` leaves out and every point of it holds."""
    if joint is None:
        return 0.0
    return max(0.0, activations[rank] + gradients - joint[rank] - held)


def gradient_copies(dp: int, pipelines: int, grad_views: bool) -> int:
    """Copies of a stage's gradients a process holds at the end of a step: the .grad
    tensors, and the flat buckets that sum them where the stage has more than one copy
    (``dp`` replicas, Chimera's ``pipelines``), unless the .grad tensors are views of the
    dp buckets (``grad_views``; Chimera's own sum still copies)."""
    return 1 + (pipelines > 1 or (dp > 1 and not grad_views))


def fit_overhead(
    step_bytes: dict[int, float],
    activation_bytes_per_sample: float,
    param_bytes: float,
    in_backward_per_sample: float = 0.0,
) -> tuple[float, float]:
    """(fraction of the activations, bytes per process) that a measured step holds beyond
    this model's count, fitted over the micro-batch sizes measured.

    ``step_bytes``: size -> the peak of a whole-model step in one process (the profile's
    ``step_memory``, which counts as the trainer's memory check counts), 0 where not
    measured. The model counts 16 bytes a parameter (4 x ``param_bytes``, its fp32 bytes),
    the saved activations and the running backward's gradients
    (``in_backward_per_sample``); what is
    left grows with the activations (the fraction) or does not (the bytes per process):
    a least-squares line, both kept >= 0. (0, 0) when fewer than two sizes were measured.
    """
    points = [
        (activation_bytes_per_sample * size, measured - 4.0 * param_bytes
         - (activation_bytes_per_sample + in_backward_per_sample) * size)
        for size, measured in sorted(step_bytes.items())
        if measured > 0
    ]  # fmt: skip
    return fit_line(points) if len(points) >= 2 else (0.0, 0.0)


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through ``points`` (x, y), both kept
    >= 0: a workspace neither shrinks as the activations grow nor holds less than nothing.
    With every x alike, the slope is 0 and the intercept the mean."""
    if not points:
        return 0.0, 0.0
    x_mean = sum(x for x, _ in points) / len(points)
    y_mean = sum(y for _, y in points) / len(points)
    spread = sum((x - x_mean) ** 2 for x, _ in points)
    slope = sum((x - x_mean) * (y - y_mean) for x, y in points) / spread if spread else 0.0
    slope = max(0.0, slope)
    return slope, max(0.0, y_mean - slope * x_mean)


def recompute_costs(costs: Sequence[LayerCost], block_input_bytes: float) -> list[LayerCost]:
    """``costs`` with every block recomputed in its backward (``torch.utils.checkpoint`` per
    block, as ``pipeline.recompute`` does): a block keeps only its input per sample
    (``block_input_bytes``) and its backward runs its forward again first."""
    out = []
    for c in costs:
        if c.kind != "block":
            out.append(c)
            continue
        out.append(
            replace(
                c,
                backward=c.backward + c.forward,
                backward_input=c.backward_input + c.forward,
                activation_bytes_per_sample=block_input_bytes,
                # The recomputed tensors live inside I; what it leaves is counted as kept.
                freed_at_input_bytes_per_sample=0.0,
            )
        )
    return out


def rank_memory(
    partition: Partition,
    costs: Sequence[LayerCost],
    *,
    weight_bytes: Sequence[float],
    peak_activation_bytes: Sequence[float],
    microbatch_size: int,
    message_bytes: float,
    copies: int = 1,
    recompute_block_bytes: float = 0.0,
    overhead: tuple[float, float] = (0.0, 0.0),
    recompute_ranks: Collection[int] | None = None,
    recompute_overhead: tuple[float, float] | None = None,
    batch_scale: int = 1,
    in_backward: Mapping[str, float] | None = None,
    peak_with_gradients: Sequence[float] | None = None,
    gradients_held: bool = False,
) -> tuple[RankMemory, ...]:
    """Each rank's bytes: ``weight_bytes`` and ``peak_activation_bytes`` are the simulator's
    per rank; ``message_bytes`` one micro-batch's activation between stages;
    ``recompute_block_bytes`` one block's full activations per sample when recomputing
    (0 without recomputation); ``overhead``: ``fit_overhead``'s (fraction, bytes).
    ``recompute_ranks``: the ranks that recompute (None: all, when recomputing), charged
    ``recompute_overhead`` (None: ``overhead``) instead of ``overhead``. ``batch_scale``:
    micro-batches an action, a recomputed block, a message carries (naive: all). ``in_backward``:
    per layer kind, what one sample's backward holds beside the saved tensors
    (``partition.workspace``); a rank is charged its largest kind's, for one action.

    The workspace's fraction is of the backward in flight (one action's micro-batches on
    the rank's largest stage), not of every live micro-batch (docs/memory_model.md).

    ``copies``: ``gradient_copies``. ``peak_with_gradients``: per rank, the simulator's
    peak of the activations with the gradients and buckets as the runtime makes them (None:
    held throughout), for ``unmet``; ``gradients_held``: the .grad tensors are views of
    persistent buckets, held all step, off that peak's timeline."""
    ranks = partition.num_ranks
    grads = [0.0] * ranks
    has_block = [False] * ranks
    running = [0.0] * ranks
    messages = [0] * ranks
    in_flight = [0.0] * ranks
    one_action = microbatch_size * batch_scale
    for stage, holders in enumerate(partition.stage_ranks):
        for rank in holders:
            grads[rank] += partition.param_bytes[stage]
            has_block[rank] |= any(costs[i].kind == "block" for i in partition.stages[stage])
            if in_backward:
                kinds = {costs[i].kind for i in partition.stages[stage]}
                running[rank] = max(running[rank], *(in_backward.get(k, 0.0) for k in kinds))
            stage_bytes = partition.activation_bytes_per_sample[stage] * one_action
            in_flight[rank] = max(in_flight[rank], stage_bytes)
    for rank in range(ranks):
        # Linear and looped placements both talk to the ranks either side of this one: a
        # receive posted ahead from each, and the activation sent on to the next.
        messages[rank] = (rank > 0) + 2 * (rank < ranks - 1)
    held = [g if gradients_held else 0.0 for g in grads]  # off the joint peak's timeline
    recomputing = set(range(ranks) if recompute_ranks is None else recompute_ranks)
    transient = [
        recompute_block_bytes * one_action if has_block[r] and r in recomputing else 0.0
        for r in range(ranks)
    ]
    kept = recompute_overhead if recompute_overhead is not None else overhead
    charged = [
        kept if r in recomputing and recompute_block_bytes else overhead for r in range(ranks)
    ]
    return tuple(
        RankMemory(
            weights=weight_bytes[r],
            gradients=copies * grads[r],
            optimizer=OPTIMIZER_FACTOR * grads[r],
            activations=peak_activation_bytes[r],
            transient=transient[r],
            buffers=messages[r] * message_bytes * batch_scale,
            workspace=charged[r][0] * (in_flight[r] + transient[r]) + charged[r][1],
            in_flight=in_flight[r] + transient[r],
            in_backward=running[r] * one_action,
            unmet=_unmet(peak_activation_bytes, copies * grads[r], peak_with_gradients, r, held[r]),
        )
        for r in range(ranks)
    )
