"""What ran, or would run, where and when: one ``Event`` per action, a ``Timeline`` of all.

The replay (``pipetrain.schedules.execution``) makes them, the runtime records them, the
simulator measures them and ``pipetrain.schedules.grid`` draws them.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipetrain.schedules.actions import Action

__all__ = ["Event", "Timeline"]


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
