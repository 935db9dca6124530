"""A step's per-batch side inputs (``step(..., extras={...})``): position ids, attention
masks. Each is cut into micro-batches like the inputs and handed to every stage of this
process whose layers ask for it; none crosses a stage boundary.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pipetrain.models import PipelineSpec
from pipetrain.runtime.errors import PipelineInputError
from pipetrain.runtime.inputs import split_batch
from pipetrain.schedules import Schedule

__all__ = ["split_extras"]


def split_extras(
    extras: Mapping[str, torch.Tensor] | None,
    spec: PipelineSpec,
    needed: frozenset[str],
    rows: int | None,
    schedule: Schedule,
    device: torch.device,
) -> dict[str, list[torch.Tensor]]:
    """``extras`` checked against the spec and ``needed`` (what this process's layers
    ask for), each cut into the schedule's micro-batches; ``rows``: the batch size of
    the step's inputs or targets, when this process has them."""
    given = dict(extras or {})
    for name in given:
        if name not in spec.extras:
            raise PipelineInputError(
                f"extras has {name!r}, which is not declared in the spec: add it to "
                f"PipelineSpec.from_layers(..., extras=) or drop it"
            )
    for name in sorted(needed - given.keys()):
        raise PipelineInputError(
            f"extras lacks {name!r}, which layers of this rank take: pass "
            f"step(..., extras={{{name!r}: tensor}}), batch first"
        )
    split = {}
    for name, value in given.items():
        where = f"extras[{name!r}]"
        tensor = isinstance(value, torch.Tensor) and value.dim() > 0
        if tensor and rows is not None and value.shape[0] != rows:
            raise PipelineInputError(
                f"{where} has batch size {value.shape[0]} but the batch {rows}: give it "
                f"one row per sequence"
            )
        split[name] = split_batch(where, value, True, schedule, device)
    return split
