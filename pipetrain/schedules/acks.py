"""When a rank may free a gradient it sent: the first message back that proves it arrived.

A transport frees a sent activation once its gradient comes back (the gradient was computed
from it), but a sent gradient gets no reply of its own; kept to the end of the step, a rank
after the first holds one activation-sized message per backward it has run. The schedule
says when it is safe sooner: a rank receives a message at its RECV action (the data is
there before the program goes on), so any message it sends to the same peer afterwards in
its program was posted after that gradient had arrived. Receiving that later message
therefore proves the gradient's send complete, and waiting for it then returns at once.
Torch-free; ``pipetrain.runtime.transport`` frees by it, the simulator counts by it.
"""

from __future__ import annotations

from pipetrain.schedules.messages import RECV_KINDS, SEND_KINDS, Message, message_of
from pipetrain.schedules.schedule import Schedule

__all__ = ["gradient_acks"]


def gradient_acks(schedule: Schedule) -> dict[int, dict[Message, tuple[Message, ...]]]:
    """Per rank R of the lowered ``schedule``: each message R receives -> the gradients R
    sent whose arrival it proves (the peer received them before it sent it). A gradient
    no later message proves stays for the end of the step."""
    acks: dict[int, dict[Message, tuple[Message, ...]]] = {
        rank: {} for rank in range(len(schedule.actions))
    }
    for program in schedule.actions:
        # Per peer: the gradients it sent here since the last message back to it.
        arrived: dict[int, list[Message]] = {}
        for action in program:
            message = message_of(action, schedule)
            if message is None or message.src_rank == message.dst_rank:
                continue
            if action.kind in RECV_KINDS and message.is_grad:
                arrived.setdefault(message.src_rank, []).append(message)
            elif action.kind in SEND_KINDS and arrived.get(message.dst_rank):
                acks[message.dst_rank][message] = tuple(arrived.pop(message.dst_rank))
    return acks
