"""Actions: the unit of every schedule.

An action names a global stage index, a kind and (usually) a micro-batch. Its text form is
``f"{stage}{kind}{microbatch}"``: ``"3F12"`` is the forward of micro-batch 12 on stage 3,
``"0SEND_B4"`` sends the input gradient of micro-batch 4 from stage 0. Kinds that concern a
whole step rather than one micro-batch (``ALLREDUCE``) print without a number:
``"2ALLREDUCE"``. ``parse_action(str(a)) == a`` for every action.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

__all__ = [
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "Action",
    "ActionParseError",
    "Kind",
    "parse_action",
]


class Kind(str, Enum):
    """What an action does. The value is its text form."""

    F = "F"  # forward of one micro-batch through one stage
    B = "B"  # full backward (input and weight gradients)
    I = "I"  # backward for the stage input only  # noqa: E741
    W = "W"  # backward for the weights only (needs the I of the same micro-batch)
    SEND_F = "SEND_F"  # send the stage output (activations) to the next stage
    RECV_F = "RECV_F"  # receive the stage input from the previous stage
    SEND_B = "SEND_B"  # send the input gradient to the previous stage
    RECV_B = "RECV_B"  # receive the output gradient from the next stage
    # Sum the gradients of the replicas of this stage (Chimera's two pipelines). Every
    # replica of the stage runs it once per step; it is a collective between their ranks.
    ALLREDUCE = "ALLREDUCE"
    # Optimizer step of this stage that creates a new weight version (asynchronous
    # schedules only; synchronous schedules step once, implicitly, after the last action).
    # The micro-batch is the one whose backward completed just before it.
    STEP = "STEP"

    def __str__(self) -> str:
        return self.value


COMPUTE_KINDS: frozenset[Kind] = frozenset({Kind.F, Kind.B, Kind.I, Kind.W})
COMM_KINDS: frozenset[Kind] = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
# Kinds whose text form carries no micro-batch.
_STEPWISE_KINDS: frozenset[Kind] = frozenset({Kind.ALLREDUCE})

# Longest alternatives first so that "SEND_F" is not read as "S" + garbage.
_KIND_ALTERNATION = "|".join(sorted((k.value for k in Kind), key=len, reverse=True))
_ACTION_RE = re.compile(rf"^\s*(\d+)\s*({_KIND_ALTERNATION})\s*(\d+)?\s*$")


class ActionParseError(ValueError):
    """A string that is not an action's text form."""


@dataclass(frozen=True, order=True)
class Action:
    """One step of one rank: ``kind`` applied to ``microbatch`` on global stage ``stage``."""

    stage: int
    kind: Kind
    microbatch: int | None = None

    def __post_init__(self) -> None:
        if self.stage < 0:
            raise ValueError(f"action stage must be >= 0, got {self.stage}")
        if self.kind in _STEPWISE_KINDS:
            if self.microbatch is not None:
                raise ValueError(f"{self.kind} takes no micro-batch, got {self.microbatch}")
        elif self.microbatch is None or self.microbatch < 0:
            raise ValueError(f"{self.kind} needs a micro-batch >= 0, got {self.microbatch}")

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{self.kind.value}{mb}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS


def parse_action(text: str) -> Action:
    """Parse the text form of an action (``"3F12"``, ``"0SEND_B4"``, ``"1ALLREDUCE"``)."""
    match = _ACTION_RE.match(text)
    if match is None:
        raise ActionParseError(
            f"{text!r} is not an action: write STAGE KIND MICROBATCH, e.g. '3F12', '0I4', "
            f"'1W4', '2B0' (kinds: {', '.join(k.value for k in Kind)})"
        )
    stage_text, kind_text, mb_text = match.groups()
    kind = Kind(kind_text)
    if kind in _STEPWISE_KINDS and mb_text is not None:
        raise ActionParseError(f"{text!r}: {kind_text} takes no micro-batch number")
    if kind not in _STEPWISE_KINDS and mb_text is None:
        raise ActionParseError(
            f"{text!r}: {kind_text} needs a micro-batch number, e.g. '{stage_text}{kind_text}0'"
        )
    return Action(int(stage_text), kind, None if mb_text is None else int(mb_text))
