"""The state of ``DistTransport``'s wires during a step (internal to the transport).

``Entry``: one message of a peer's wire order as this rank sees it; ``Peer``: the wire to
one peer (its entries in order and how far the step has come); ``Pending``: a receive in
flight. ``peer_entries`` turns a program's wire orders into entries once per program: the
orders are static, so each step only resets the counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pipetrain.runtime.wire_format import MessageKey, Specs
from pipetrain.schedules.wire import PeerOrders

__all__ = ["Entry", "Peer", "PeerEntries", "Pending", "peer_entries"]


class Pending:
    """A receive in flight: its header, and its payload once its shapes are known; or, for
    a packed message (``wire_format.pack``), one buffer holding both."""

    __slots__ = (
        "header",
        "header_work",
        "packed",
        "payload",
        "payload_works",
        "predicted",
        "specs",
        "src",
    )

    def __init__(self, src: int, header: torch.Tensor | None, header_work: Any) -> None:
        self.src = src
        self.header = header
        self.header_work = header_work
        self.packed: torch.Tensor | None = None
        self.payload: tuple[torch.Tensor, ...] | None = None
        self.payload_works: list[Any] = []
        self.predicted: Specs | None = None  # shapes the payload was posted with, unread
        self.specs: Specs | None = None  # shapes the header announced, once read


@dataclass(frozen=True)
class Entry:
    """One message of a peer's wire order, seen from this rank."""

    key: MessageKey
    src_stage: int
    outgoing: bool


class Peer:
    """The wire to one peer rank during a step: its messages in order, and how far we are."""

    __slots__ = ("ahead", "head", "index", "order", "rank")

    def __init__(self, rank: int, order: tuple[Entry, ...], index: dict[MessageKey, int]) -> None:
        self.rank = rank
        self.order = order
        self.index = index  # shared by the steps of one program: read only
        self.head = 0  # the next entry to post (a receive) or to issue (a send)
        self.ahead = 0  # payload receives posted and not yet taken by a RECV


# Per peer rank: its entries in wire order, and each message's place in them.
PeerEntries = dict[int, tuple[tuple[Entry, ...], dict[MessageKey, int]]]


def peer_entries(rank: int, wire: PeerOrders) -> PeerEntries:
    """``wire`` (one program's orders by peer) as entries seen from ``rank``."""
    out: PeerEntries = {}
    for peer, messages in wire.items():
        order = tuple(
            Entry(MessageKey(m.dst_stage, m.is_grad, m.microbatch), m.src_stage, m.src_rank == rank)
            for m in messages
        )
        out[peer] = (order, {entry.key: i for i, entry in enumerate(order)})
    return out
