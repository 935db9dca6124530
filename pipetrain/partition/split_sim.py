"""One split of the layers, simulated under one schedule: the stage sums become the
actions' durations and bytes (torch-free). ``plan`` and ``plan --auto`` both score a split
through it, so the two count a step and its memory alike."""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.partition.balance import Partition, deferred_bytes, freed_at_input_bytes
from pipetrain.schedules.execution import Costs
from pipetrain.schedules.schedule import Schedule
from pipetrain.sim.ranks import with_rank_speeds
from pipetrain.sim.simulator import SimResult, simulate

__all__ = ["simulate_split"]


def simulate_split(
    schedule: Schedule,
    partition: Partition,
    microbatch_size: int,
    *,
    per_layer: float = 0.0,
    per_action: float = 0.0,
    latency: float = 0.0,
    bandwidth: float | None = None,
    message_bytes: float = 0.0,
    batch_scale: int = 1,
    speeds: Sequence[float] | None = None,
    buckets: bool = False,
    gradients_held: bool = False,
) -> SimResult:
    """``schedule`` replayed with ``partition``'s per-sample stage sums at micro-batch
    ``microbatch_size``: ``per_layer`` seconds added per layer to every F, I and W (twice
    to a B) and ``per_action`` to every action, messages of ``message_bytes`` taking
    ``latency`` plus their bytes over ``bandwidth``; ``batch_scale`` micro-batches per
    action (naive model parallel: m); ``speeds``, one per rank, divide that rank's times;
    ``buckets``: flat copies of the gradients are summed after a stage's last backward
    (``partition.memory.gradient_copies`` says where), and count with them;
    ``gradients_held``: the .grad tensors are held all step (views of persistent buckets),
    so the timeline leaves them out and the memory count adds them throughout."""
    mb = microbatch_size
    fixed = [per_layer * len(layers) for layers in partition.stages]
    # The simulator multiplies an action's time by ``batch_scale``; one action's own cost
    # is paid once however many micro-batches it carries.
    own = per_action / batch_scale

    def durations(values: Sequence[float], times: int) -> tuple[float, ...]:
        return tuple(v * mb + times * f + own for v, f in zip(values, fixed, strict=True))

    costs = Costs(
        forward=durations(partition.forward, 1),
        backward=durations(partition.backward, 2),
        backward_input=durations(partition.backward_input, 1),
        backward_weight=durations(partition.backward_weight, 1),
        latency=latency,
        bandwidth=bandwidth,
        message_bytes=message_bytes,
    )
    if speeds is not None:  # a stage on a rank of speed 0.5 takes twice as long
        costs = with_rank_speeds(costs, schedule.placement, speeds)
    grads = tuple(float(b) for b in partition.param_bytes)
    return simulate(
        schedule,
        costs,
        activation_bytes=tuple(a * mb for a in partition.activation_bytes_per_sample),
        weight_bytes=grads,
        batch_scale=batch_scale,
        deferred_bytes=deferred_bytes(partition, mb),
        freed_bytes=freed_at_input_bytes(partition, mb),
        sent_bytes=message_bytes,
        gradient_bytes=tuple(0.0 for _ in grads) if gradients_held else grads,
        bucket_bytes=grads if buckets else None,
    )
