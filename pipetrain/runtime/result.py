"""What one step of a pipeline returns (``Pipeline.step``), the same on every rank."""

from __future__ import annotations

from dataclasses import dataclass

from pipetrain.schedules.execution import Timeline

__all__ = ["StepResult"]


@dataclass(frozen=True)
class StepResult:
    """What one step returns, the same on every rank."""

    loss: float  # mean loss per target token over the whole batch
    tokens: int  # target tokens that count (not -100)
    timeline: Timeline  # measured actions of every rank, seconds from the step's start
    step_time_s: float  # wall time of the step on this rank
