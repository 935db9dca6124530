"""What each action waits for: the dependency rules shared by replay and the validator.

The rules (facts of backpropagation, not of any one schedule):

- ``F(s, k)`` needs ``F(prev(s), k)``; a first stage needs nothing.
- ``B(s, k)`` or ``I(s, k)`` needs its own ``F(s, k)`` and the input gradient from the next
  stage, ``B`` or ``I`` of ``(next(s), k)``; a last stage needs only its ``F`` (the loss
  sits right after it).
- ``W(s, k)`` needs ``I(s, k)``.
- ``STEP(s, k)`` follows the backward of ``(s, k)``: ``B``, or ``W`` when it is split.
- ``ALLREDUCE(s)`` is a collective; replay synchronises it separately.

In a compute-only schedule an edge between stages on different ranks is implicit and
costs one transfer. In a lowered schedule (one with sends and receives) such an edge goes
through the receive on the consumer's rank, which waits for the matching send. Edges
between stages on the same rank (interleaved neighbours, the turn of a V) never cost a
transfer: the tensors stay in memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.placement import Placement

__all__ = ["BACKWARD_INPUT_KINDS", "Requirement", "requirements"]

# Kinds that produce a stage's input gradient (the backward that the previous stage needs).
BACKWARD_INPUT_KINDS: frozenset[Kind] = frozenset({Kind.B, Kind.I})


@dataclass(frozen=True)
class Requirement:
    """One thing an action waits for: the first of ``alternatives`` the schedule contains.

    Alternatives exist because a backward may be whole (``B``) or split (``I`` then
    ``W``). ``transfer`` is True when the data crosses ranks, so the wait adds one
    ``Costs.transfer()``. Empty ``alternatives`` mean nothing can ever satisfy the action
    (a receive on a stage that has no sender).
    """

    alternatives: tuple[Action, ...]
    transfer: bool = False

    def __str__(self) -> str:
        if not self.alternatives:
            return "a message that no stage can send"
        return " or ".join(str(a) for a in self.alternatives)


def _backward_of(stage: int, mb: int) -> tuple[Action, ...]:
    return (Action(stage, Kind.B, mb), Action(stage, Kind.I, mb))


def requirements(action: Action, placement: Placement, *, lowered: bool) -> tuple[Requirement, ...]:
    """The requirements of ``action`` under ``placement`` (see the module docstring)."""
    s, kind, mb = action.stage, action.kind, action.microbatch
    if kind is Kind.ALLREDUCE or mb is None:
        return ()
    rank = placement.rank_of(s) if s < placement.num_stages else -1
    prev, nxt = _neighbours(s, placement)

    if kind is Kind.F:
        if prev is None:
            return ()
        crosses = placement.rank_of(prev) != rank
        if crosses and lowered:
            return (Requirement((Action(s, Kind.RECV_F, mb),)),)
        return (Requirement((Action(prev, Kind.F, mb),), crosses),)

    if kind in BACKWARD_INPUT_KINDS:
        own_forward = Requirement((Action(s, Kind.F, mb),))
        if nxt is None:
            return (own_forward,)
        crosses = placement.rank_of(nxt) != rank
        if crosses and lowered:
            return (own_forward, Requirement((Action(s, Kind.RECV_B, mb),)))
        return (own_forward, Requirement(_backward_of(nxt, mb), crosses))

    if kind is Kind.W:
        return (Requirement((Action(s, Kind.I, mb),)),)
    if kind is Kind.STEP:
        return (Requirement((Action(s, Kind.B, mb), Action(s, Kind.W, mb))),)
    if kind is Kind.SEND_F:
        return (Requirement((Action(s, Kind.F, mb),)),)
    if kind is Kind.SEND_B:
        return (Requirement(_backward_of(s, mb)),)
    if kind is Kind.RECV_F:
        if prev is None:
            return (Requirement(()),)
        return (Requirement((Action(prev, Kind.SEND_F, mb),), True),)
    # RECV_B
    if nxt is None:
        return (Requirement(()),)
    return (Requirement((Action(nxt, Kind.SEND_B, mb),), True),)


def _neighbours(stage: int, placement: Placement) -> tuple[int | None, int | None]:
    """Previous and next stage, or None at the ends (and for a stage outside the placement)."""
    if stage >= placement.num_stages:
        return None, None
    return placement.prev_stage(stage), placement.next_stage(stage)
