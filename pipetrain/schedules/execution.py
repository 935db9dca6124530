"""The reference semantics of a schedule: what each action waits for, and a timed replay.

One engine serves the validator (unit costs; a stall is a deadlock), the simulator
(per-stage costs; metrics from the timeline) and the comparison with measured runs (the
runtime records the same ``Timeline`` type).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipetrain.schedules.actions import Action, Kind

__all__ = ["Costs", "Event", "Timeline"]


def _per_stage(value: float | Sequence[float], model_stage: int) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    return float(value[model_stage])


@dataclass(frozen=True)
class Costs:
    """Durations of actions, scalar for every stage or one value per model stage.

    Defaults are the papers' unit costs: F = I = W = 1, B = 2, free communication.
    """

    forward: float | tuple[float, ...] = 1.0
    backward: float | tuple[float, ...] = 2.0
    backward_input: float | tuple[float, ...] = 1.0
    backward_weight: float | tuple[float, ...] = 1.0
    # Transfer time of one message = latency + message_bytes / bandwidth (bandwidth in
    # bytes per time unit; None means infinite).
    latency: float = 0.0
    bandwidth: float | None = None
    message_bytes: float = 0.0
    allreduce: float = 0.0
    step: float = 0.0

    def compute(self, kind: Kind, model_stage: int) -> float:
        """Duration of a compute (or step-level) action on one model stage."""
        table = {
            Kind.F: self.forward,
            Kind.B: self.backward,
            Kind.I: self.backward_input,
            Kind.W: self.backward_weight,
        }
        if kind in table:
            return _per_stage(table[kind], model_stage)
        if kind is Kind.ALLREDUCE:
            return self.allreduce
        if kind is Kind.STEP:
            return self.step
        return 0.0

    def transfer(self) -> float:
        """Time from a send being issued to the data being available at the receiver."""
        extra = 0.0 if not self.bandwidth else self.message_bytes / self.bandwidth
        return self.latency + extra


@dataclass(frozen=True)
class Event:
    """One action as it ran (or would run): on ``rank``, from ``start`` to ``end``."""

    rank: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Timeline:
    """Events of every rank, simulated or measured. Times in any unit, from 0."""

    name: str
    num_ranks: int
    events: tuple[Event, ...]

    @property
    def makespan(self) -> float:
        if not self.events:
            return 0.0
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    def of_rank(self, rank: int) -> tuple[Event, ...]:
        return tuple(e for e in self.events if e.rank == rank)
