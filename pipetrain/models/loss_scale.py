"""What the micro-batch being run divides its summed loss by, for layers with a loss of
their own (a mixture of experts' load-balancing loss).

The runtime sums each micro-batch's token losses and divides by the batch's count of
targets (``runtime.loss``); an auxiliary loss computed inside a layer must enter the
backward on the same scale, or its weight would change with the number of micro-batches.
The stage runner sets the divisor around each forward; a layer run outside a pipeline sees
none and weighs its auxiliary loss as if its input were the whole batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

__all__ = ["dividing_loss_by", "loss_divisor"]

_DIVISOR: ContextVar[float | None] = ContextVar("pipetrain_loss_divisor", default=None)


@contextlib.contextmanager
def dividing_loss_by(divisor: float) -> Iterator[None]:
    """Within: the current micro-batch's summed loss is divided by ``divisor``."""
    token = _DIVISOR.set(divisor)
    try:
        yield
    finally:
        _DIVISOR.reset(token)


def loss_divisor() -> float | None:
    """The divisor of the micro-batch being run; None outside a pipeline step."""
    return _DIVISOR.get()
