"""What the pictures of timelines share: their error, the one line for a path that
cannot be written, and where each stage sits among its rank's chunks."""

from __future__ import annotations

from pathlib import Path

from pipetrain.errors import InputError
from pipetrain.schedules.execution import Timeline

__all__ = ["RenderError", "rank_chunks", "unwritable"]


class RenderError(InputError):
    """A picture that cannot be made as asked (unknown file suffix, no matplotlib, a path
    that cannot be written)."""


def rank_chunks(timeline: Timeline) -> dict[int, tuple[int, int]]:
    """Stage -> (its chunk index on its rank, how many chunks that rank holds)."""
    per_rank: dict[int, set[int]] = {}
    for e in timeline.events:
        per_rank.setdefault(e.rank, set()).add(e.action.stage)
    return {
        stage: (index, len(stages))
        for stages in per_rank.values()
        for index, stage in enumerate(sorted(stages))
    }


def unwritable(out: Path, exc: OSError) -> RenderError:
    """The one line for a picture or trace that cannot be written where asked."""
    reason = exc.strerror or str(exc)
    return RenderError(f"cannot write {str(out)!r}: {reason}: pick a writable file path")
