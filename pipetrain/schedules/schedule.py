"""Schedule: a placement plus each rank's ordered list of actions."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from pipetrain.errors import InputError
from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.placement import Placement

__all__ = ["Schedule", "ScheduleError"]


class ScheduleError(InputError):
    """A schedule that cannot run, or parameters that no schedule of a family fits.

    The message is one line that names the problem and what to change. ``grid`` holds an
    optional multi-line picture of the schedule with the failing step marked.
    """

    def __init__(self, message: str, grid: str = "") -> None:
        super().__init__(message)
        self.grid = grid


@dataclass(frozen=True)
class Schedule:
    """The single representation shared by validator, simulator, pictures and runtime.

    ``actions[r]`` is rank r's ordered program. Compute-only schedules come out of the
    generators; ``lowering.lower`` adds the sends and receives.
    """

    name: str
    placement: Placement
    microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    # True for PipeDream-style schedules: weights change inside the step (STEP actions).
    asynchronous: bool = False
    # Free-form parameters of the generator (e.g. {"v": 2}), kept for reports.
    params: tuple[tuple[str, int], ...] = field(default=())

    @classmethod
    def build(
        cls,
        name: str,
        placement: Placement,
        microbatches: int,
        actions: Sequence[Sequence[Action]],
        *,
        asynchronous: bool = False,
        params: dict[str, int] | None = None,
    ) -> Schedule:
        return cls(
            name,
            placement,
            microbatches,
            tuple(tuple(rank_actions) for rank_actions in actions),
            asynchronous,
            tuple(sorted((params or {}).items())),
        )

    @property
    def num_ranks(self) -> int:
        return self.placement.num_ranks

    @property
    def is_lowered(self) -> bool:
        return any(a.is_comm for rank in self.actions for a in rank)

    @property
    def splits_backward(self) -> bool:
        """True when backward runs as I then W (the zero-bubble family)."""
        return any(a.kind is Kind.I for rank in self.actions for a in rank)

    def enumerate_actions(self) -> Iterator[tuple[int, int, Action]]:
        """Yield ``(rank, position, action)`` for every action."""
        for rank, rank_actions in enumerate(self.actions):
            for pos, action in enumerate(rank_actions):
                yield rank, pos, action

    def compute_only(self) -> Schedule:
        """The same schedule with sends and receives removed."""
        return Schedule(
            self.name,
            self.placement,
            self.microbatches,
            tuple(tuple(a for a in rank if not a.is_comm) for rank in self.actions),
            self.asynchronous,
            self.params,
        )
