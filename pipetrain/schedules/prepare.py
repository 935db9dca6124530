"""Preparing a schedule for a run: the one place that turns what a user named into what
the runtime executes.

``prepare_schedule`` resolves a built-in name (``registry``), a CSV or JSON file (``io``)
or a ``Schedule`` given as is; chooses early input gradients for a built-in one
(``early_grads``); validates it, lowers it to sends and receives (``lowering``) and
validates the lowered program. A run prepares its schedule once: ``pipetrain train``'s
plan prepares it for its checks and hands the ``PreparedSchedule`` to ``build_pipeline``,
which prepares one itself only when it is given a name, a file or a ``Schedule``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipetrain.schedules import io
from pipetrain.schedules.early_grads import early_grads, early_splits
from pipetrain.schedules.lowering import lower
from pipetrain.schedules.registry import build_schedule
from pipetrain.schedules.schedule import Schedule
from pipetrain.schedules.validate import validate

__all__ = ["PreparedSchedule", "is_schedule_file", "prepare_schedule"]

_SCHEDULE_FILE_SUFFIXES = (".csv", ".json")


@dataclass(frozen=True)
class PreparedSchedule:
    """A schedule ready to run, and the plain one it was lowered from."""

    # As built, loaded or given, with early input gradients where they were chosen; the
    # messages only where a file or a given schedule placed them by hand. What the
    # simulator replays and a plan's checks read.
    schedule: Schedule
    # The same, validated, with every cross-rank send and receive: what the runtime runs.
    lowered: Schedule
    # The backwards that early input gradients split (``1I7``; ``early_grads.early_splits``).
    early_splits: tuple[str, ...] = ()


def is_schedule_file(source: str) -> bool:
    """True when ``source`` names a CSV or JSON file rather than a built-in schedule."""
    return source.lower().endswith(_SCHEDULE_FILE_SUFFIXES)


def prepare_schedule(
    source: str | Schedule,
    ranks: int,
    microbatches: int,
    chunks: int | None = None,
    *,
    early: bool = True,
) -> PreparedSchedule:
    """``source`` resolved, validated and lowered (see the module doc).

    A built-in name is built for ``ranks``, ``microbatches`` and ``chunks`` and gets early
    input gradients unless ``early`` is False; a file is loaded for ``ranks`` (a CSV file
    also for ``microbatches``) and, like a ``Schedule``, runs as it is written. Bad input
    raises ``ScheduleError`` (an ``InputError``) with one line naming the fix.
    """
    splits: tuple[str, ...] = ()
    if isinstance(source, Schedule):
        schedule = source
    elif isinstance(source, str) and is_schedule_file(source):
        schedule = _load(source, ranks, microbatches)
    else:
        schedule = build_schedule(source, ranks, microbatches, chunks=chunks)
        if early:
            plain, schedule = schedule, early_grads(schedule)
            splits = tuple(early_splits(plain, schedule))
    validate(schedule)
    lowered = lower(schedule)
    validate(lowered)
    return PreparedSchedule(schedule, lowered, splits)


def _load(path: str, ranks: int, microbatches: int) -> Schedule:
    """A user's schedule file (``pipetrain simulate --save`` writes one), validated on
    loading. Every rank loads the same file, so it must be readable there on every node."""
    if path.lower().endswith(".csv"):
        return io.load_csv(path, num_ranks=ranks, microbatches=microbatches)
    return io.load_json(path, num_ranks=ranks)
