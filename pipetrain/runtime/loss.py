"""The loss reduction, explicit: what ``loss_fn`` returns for a micro-batch.

The pipeline adds up the micro-batches' losses and divides by the whole batch's count of
targets, so it needs each micro-batch's loss summed over its targets. A ``loss_fn`` of the
caller's comes with ``loss_reduction``, which says what it returns: "sum" is taken as it
is; "mean" (the mean over the targets that count, not -100, as ``F.cross_entropy`` gives
by default) is multiplied by the micro-batch's count of them, so that the gradients are
those of the full batch's mean. A ``loss_fn`` without it is refused in one line when the
pipeline is built: most losses cannot be told apart by their values, and the wrong
reduction scales loss and gradients silently. The built-in cross-entropy (no ``loss_fn``)
is summed and needs no declaration.

A reduction declared wrong would scale the loss and gradients just as silently, so the
first micro-batch is probed where the loss looks like a token cross-entropy (integer
targets shaped like the logits without their last dimension): a "sum" loss equal to the
summed cross-entropy divided by the count, or a "mean" loss equal to the sum itself, is
refused in one line.
"""

from __future__ import annotations

import math

import torch

from pipetrain.runtime.errors import PipelineInputError
from pipetrain.runtime.inputs import checked_loss
from pipetrain.runtime.stage import IGNORE_INDEX, LossFn, token_cross_entropy

__all__ = ["LOSS_REDUCTIONS", "reduced_loss"]

LOSS_REDUCTIONS = ("sum", "mean")


def reduced_loss(loss_fn: LossFn | None, reduction: str | None) -> LossFn:
    """``loss_fn`` (None: the summed token cross-entropy) as a loss summed over the
    micro-batch's targets, checked (``checked_loss``), given its declared ``reduction``
    (required with a ``loss_fn``; "sum" or None without one)."""
    if reduction is not None and reduction not in LOSS_REDUCTIONS:
        raise PipelineInputError(
            f"loss_reduction={reduction!r}: pass 'sum' (loss_fn returns the loss summed over "
            f"the targets) or 'mean' (averaged over the targets that are not -100)"
        )
    if loss_fn is not None and reduction is None:
        raise PipelineInputError(
            "loss_fn is given without loss_reduction: pass loss_reduction='sum' (loss_fn "
            "returns the loss summed over the micro-batch's targets) or loss_reduction='mean' "
            "(averaged over the targets that are not -100)"
        )
    if loss_fn is None:
        if reduction == "mean":
            raise PipelineInputError(
                "loss_reduction='mean' describes a loss_fn of yours, but none is given (the "
                "default cross-entropy is summed): drop loss_reduction or pass loss_fn"
            )
        return checked_loss(token_cross_entropy)
    checked = checked_loss(loss_fn)
    mean = reduction == "mean"
    probed = False

    def run(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        nonlocal probed
        loss = checked(logits, targets)
        if not probed:
            probed = True
            _probe(loss, logits, targets, mean)
        if not mean:
            return loss
        count = int((targets != IGNORE_INDEX).sum())
        # The mean of no targets is NaN; they contribute nothing (with a gradient of zero).
        return loss * count if count else logits.sum() * 0.0

    return run


def _probe(loss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, mean: bool) -> None:
    """Refuse a loss that is, to rounding, the other reduction of the cross-entropy."""
    if type(logits) is not torch.Tensor or type(loss) is not torch.Tensor:
        return  # sharded logits (tensor parallelism): not probed
    if targets.is_floating_point() or tuple(targets.shape) != tuple(logits.shape[:-1]):
        return
    count = int((targets != IGNORE_INDEX).sum())
    if count < 2:
        return
    try:
        with torch.no_grad():
            total = float(token_cross_entropy(logits.detach(), targets))
    except (RuntimeError, IndexError, ValueError):
        return
    value = float(loss.detach())

    def near(a: float, b: float) -> bool:
        return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)

    if not mean and near(value, total / count) and not near(value, total):
        raise PipelineInputError(
            f"loss_fn returned the mean over the micro-batch's {count} targets, not their "
            f"sum (loss and gradients would shrink by the batch size): pass "
            f"loss_reduction='mean' to build_pipeline, or reduce with 'sum'"
        )
    if mean and near(value, total) and not near(value, total / count):
        raise PipelineInputError(
            f"loss_reduction='mean' but loss_fn returned the sum over the micro-batch's "
            f"{count} targets: pass loss_reduction='sum', or reduce with 'mean'"
        )
