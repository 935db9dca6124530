"""The debug mode's transport: every rank runs in this process, messages match by name."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipetrain.runtime.errors import PipelineError
from pipetrain.runtime.wire_format import Acks, MessageKey, header_values
from pipetrain.schedules.wire import PeerOrders

__all__ = ["InMemoryTransport"]


class InMemoryTransport:
    """Messages between ranks that all run in this process (the debug mode).

    ``recv`` returns None when the message has not been sent yet: the caller then runs
    another rank. Tensors are handed over as they are, exactly as a copy over the wire
    would arrive, so the arithmetic is the same as with processes.
    """

    def __init__(self) -> None:
        self._box: dict[MessageKey, tuple[torch.Tensor, ...]] = {}
        self._where = "step 0"

    def begin_step(
        self, step: int, wires: Sequence[PeerOrders], where: str = "", acks: Acks | None = None
    ) -> None:
        del wires, acks  # matched by name in memory: no wire to order, no send to free
        self._where = where or f"step {step}"
        # A pass that failed part-way leaves its unreceived messages behind; their names
        # come again in this pass, which must not take them for its own.
        self._box.clear()

    def end_step(self) -> None:
        if self._box:
            keys = ", ".join(str(k) for k in self._box)
            raise PipelineError(f"{self._where} ended with messages never received: {keys}")

    def send(self, key: MessageKey, src_stage: int, tensors: tuple[torch.Tensor, ...]) -> None:
        # What the wire's header cannot carry fails here as it would between processes,
        # so that a model the debug mode runs also runs on several ranks.
        header_values(0, src_stage, key, tensors)
        self._box[key] = tuple(t.detach() for t in tensors)

    def progress(self) -> None:
        return None

    def recv(self, key: MessageKey, src_stage: int) -> tuple[torch.Tensor, ...] | None:
        del src_stage
        return self._box.pop(key, None)
