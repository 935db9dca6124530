"""Measured timelines: the start and end of every action, always recorded, cheaply.

Each rank writes ``time.perf_counter_ns()`` readings into a list allocated once per
program (two slots per action), relative to a barrier at the start of the step. The lists
become the simulator's ``Timeline`` type, in seconds, so the same metrics and pictures
apply to a measured run and a simulated one.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.schedules import Action
from pipetrain.schedules.execution import Event, Timeline

__all__ = ["ActionClock", "merge_timelines", "rank_events"]

_NS = 1e-9


class ActionClock:
    """Preallocated (start, end) slots, in nanoseconds, for one rank's actions of a step."""

    __slots__ = ("origin_ns", "times")

    def __init__(self, num_actions: int) -> None:
        self.times: list[int] = [0] * (2 * num_actions)
        self.origin_ns = 0

    def relative(self) -> list[int]:
        """The readings as nanoseconds since the step's origin."""
        origin = self.origin_ns
        return [t - origin for t in self.times]


def rank_events(
    rank: int, actions: Sequence[Action], relative_ns: Sequence[float]
) -> tuple[Event, ...]:
    """One rank's events from its actions and (start, end) readings since the origin."""
    return tuple(
        Event(rank, action, relative_ns[2 * i] * _NS, relative_ns[2 * i + 1] * _NS)
        for i, action in enumerate(actions)
    )


def merge_timelines(name: str, num_ranks: int, per_rank: Sequence[tuple[Event, ...]]) -> Timeline:
    """All ranks' events in one timeline, ordered by start time."""
    events = sorted((e for events in per_rank for e in events), key=lambda e: (e.start, e.rank))
    return Timeline(name, num_ranks, tuple(events))
