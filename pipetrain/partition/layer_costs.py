"""What one pipeline layer costs, and how a stage's memory is counted (torch-free).

``LayerCost`` comes from profiling or estimating a model (``pipetrain.partition.profile``,
``pipetrain.partition.estimate``); ``MemoryModel`` is the per-rank limit the balanced splits
(``pipetrain.partition.balance``) and their searches (``pipetrain.partition.search``) meet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

__all__ = ["TIMES", "LayerCost", "MemoryModel", "scaled_times", "shared_within"]

# The fields of a LayerCost that are times (the rest are sizes).
TIMES = ("forward", "backward", "backward_input", "backward_weight")


@dataclass(frozen=True)
class LayerCost:
    """What one pipeline layer costs. Times are seconds for one sample (one sequence)."""

    name: str
    kind: str  # "embedding" | "block" | "head"
    forward: float
    backward: float  # input and weight gradients together
    backward_input: float
    backward_weight: float
    params: int
    param_bytes: int
    activation_bytes_per_sample: float  # what the backward needs kept, per sample
    # A tied copy (the LM head's output weight): the layer that owns the weight, and the
    # parameters of it counted above. A stage holding both holds one tensor.
    tied_to: int | None = None
    tied_params: int = 0
    tied_param_bytes: int = 0
    # What a split backward keeps from its I to its W beyond the activations, per sample:
    # the output gradient of every linear layer, which the deferred weight products need
    # (``pipetrain.runtime.stage``); 0 where the layer has no linear.
    deferred_bytes_per_sample: float = 0.0
    # The part of ``activation_bytes_per_sample`` that a split backward lets go at the end
    # of its I, per sample: the saved tensors that are no linear's input (W needs only
    # those); 0 (the whole activations kept to W) where not known.
    freed_at_input_bytes_per_sample: float = 0.0

    @property
    def time(self) -> float:
        return self.forward + self.backward


def scaled_times(costs: Sequence[LayerCost], factor: float) -> list[LayerCost]:
    """``costs`` with every time times ``factor``; the sizes as they were."""
    return [replace(c, **{name: getattr(c, name) * factor for name in TIMES}) for c in costs]


def shared_within(costs: Sequence[LayerCost], start: int, end: int, attr: str) -> int:
    """What layers start..end-1 count twice: tied copies whose owner is among them too."""
    return sum(
        getattr(c, attr)
        for c in costs[start:end]
        if c.tied_to is not None and start <= c.tied_to < end
    )


@dataclass(frozen=True)
class MemoryModel:
    """The per-rank memory limit and how a stage's memory is counted."""

    limit_bytes: float
    microbatch_size: int
    # Peak live micro-batches per stage (index = stage); the schedule decides them.
    live: tuple[int, ...]
    # Parameter bytes times this = parameters + gradients + optimizer state (fp32 AdamW: 4).
    state_factor: float = 4.0
    # Weight versions held per stage (index = stage; empty: one each). PipeDream stashes
    # older versions for the micro-batches still in flight, each a full copy of the weights.
    weight_versions: tuple[int, ...] = ()
    # Per rank, the counts of live micro-batches per model stage (index = stage) at each
    # point where its activations may peak; empty: a rank is charged the sum of its
    # stages' ``live`` peaks. A rank holding several stages seldom peaks on all at once.
    rank_live: tuple[tuple[tuple[int, ...], ...], ...] = ()
    # Every action carries all the micro-batches (naive model parallel): the batch size,
    # not the micro-batch count, sets the activations (``live`` already counts them all).
    whole_batch: bool = False
    # Per rank, its own limit (``--rank-memory``: a device with less memory); empty: every
    # rank has ``limit_bytes``.
    rank_limit_bytes: tuple[float, ...] = ()

    def limit_of(self, rank: int) -> float:
        """The memory limit of ``rank``."""
        return self.rank_limit_bytes[rank] if self.rank_limit_bytes else self.limit_bytes

    def param_factor(self, stage: int) -> float:
        """Parameter bytes times this = what the stage's weights cost with their state."""
        versions = self.weight_versions[stage] if self.weight_versions else 1
        return self.state_factor + versions - 1

    def stage_bytes(self, costs: Sequence[LayerCost], stage: int, start: int, end: int) -> float:
        params = sum(c.param_bytes for c in costs[start:end])
        params -= shared_within(costs, start, end, "tied_param_bytes")
        activations = sum(c.activation_bytes_per_sample for c in costs[start:end])
        return self.param_factor(stage) * params + (
            activations * self.microbatch_size * self.live[stage]
        )
