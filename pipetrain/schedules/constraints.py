"""Constraint checks shared by the generators and the registry.

A check returns None when the parameters fit, else one line that says what is wrong and
what to change, in the words of the CLI flags (``--pp``, ``--microbatches``, ``--chunks``).
Generators raise it as ``ScheduleError``; the registry reports it up front.
"""

from __future__ import annotations

from pipetrain.schedules.schedule import ScheduleError

__all__ = ["check_basic", "raise_if"]


def check_basic(name: str, p: int, m: int, v: int = 1) -> str | None:
    """The limits every schedule shares: at least one rank, micro-batch and chunk."""
    if p < 1:
        return f"{name} needs --pp >= 1 (got {p}): use 1 or more pipeline ranks"
    if m < 1:
        return f"{name} needs --microbatches >= 1 (got {m}): use 1 or more micro-batches"
    if v < 1:
        return f"{name} needs --chunks >= 1 (got {v}): use 1 or more stages per rank"
    return None


def raise_if(problem: str | None) -> None:
    """Raise ``ScheduleError`` with ``problem`` when a check found one."""
    if problem is not None:
        raise ScheduleError(problem)
