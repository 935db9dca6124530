"""Messages of a lowered schedule: what one SEND or RECV action moves between two ranks.

``pipetrain.schedules.wire`` orders them per pair of ranks and
``pipetrain.schedules.wire_check`` runs such orders in a model of NCCL's streams.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.schedule import Schedule, ScheduleError

__all__ = ["RECV_KINDS", "SEND_KINDS", "Message", "Pair", "PeerOrders", "message_of"]

SEND_KINDS = frozenset({Kind.SEND_F, Kind.SEND_B})
RECV_KINDS = frozenset({Kind.RECV_F, Kind.RECV_B})

Pair = tuple[int, int]  # (lower rank, higher rank)
# One rank's wire orders: for each peer rank, the messages between the two in order.
PeerOrders = Mapping[int, tuple["Message", ...]]


@dataclass(frozen=True, order=True)
class Message:
    """One message of a step: what ``dst_stage`` receives from ``src_stage`` for a micro-batch."""

    src_rank: int
    dst_rank: int
    src_stage: int
    dst_stage: int
    is_grad: bool
    microbatch: int

    def __str__(self) -> str:
        what = "gradient" if self.is_grad else "activations"
        return f"{what} {self.src_stage}->{self.dst_stage} of micro-batch {self.microbatch}"

    @property
    def boundary(self) -> tuple[int, int, bool]:
        """(source stage, destination stage, is_grad): messages that share their shapes."""
        return self.src_stage, self.dst_stage, self.is_grad


def message_of(action: Action, schedule: Schedule) -> Message | None:
    """The message a SEND or RECV action moves; None for any other action."""
    placement, s, mb = schedule.placement, action.stage, action.microbatch
    if mb is None or action.kind not in SEND_KINDS | RECV_KINDS:
        return None
    is_grad = action.kind in (Kind.SEND_B, Kind.RECV_B)
    if action.kind in SEND_KINDS:
        other = s - 1 if is_grad else s + 1
        src, dst = s, other
    else:
        other = s + 1 if is_grad else s - 1
        src, dst = other, s
    if not 0 <= other < placement.num_stages:
        raise ScheduleError(
            f"action {action} moves a message to or from stage {other}, which does not exist: "
            f"lower the schedule with pipetrain.schedules.lowering.lower"
        )
    return Message(placement.rank_of(src), placement.rank_of(dst), src, dst, is_grad, mb)
