"""A run's metrics file: one JSON object per line, each line written whole.

Each line is one ``os.write`` to a file opened with ``O_APPEND``: no buffer holds half a
line for a later flush, so a crash (SIGKILL, the OOM killer) leaves whole lines only, and
another reader sees lines appear whole. A write that fails (a full disk) or stops short
takes its partial bytes back and ends the run in one line (``MetricsError``), keeping every
line written before it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipetrain.config.run_folder import free_name
from pipetrain.errors import InputError

__all__ = ["MetricsError", "MetricsFile"]


class MetricsError(InputError):
    """An output that cannot be written, or an optional logger that is not installed."""


class MetricsFile:
    """One JSON object per line, on disk (in the page cache) as soon as it is written."""

    def __init__(self, path: Path, *, append: bool = False) -> None:
        """``append``: keep the lines already there (a resumed run continues its own file)."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Checked here, but emptied only at the first record: a run refused before its
            # first step (a checkpoint directory in use, say) leaves the last run's lines.
            path.open("a", encoding="utf-8").close()
        except OSError as exc:
            raise MetricsError(
                f"run.metrics {str(path)!r} cannot be written ({exc.strerror}): choose another path"
            ) from None
        self.path = path
        self._append = append
        self._truncate = not append  # a new run's file is emptied at its first record
        self._fd: int | None = None

    def resume_from(self, step: int) -> str | None:
        """Before a resumed run's first record: move what the earlier attempt wrote after
        ``step`` (the checkpoint resumed from; it crashed or was stopped later) to a file
        of its own, so that this file holds one trajectory; a note saying so, or None.

        Records are written in step order, so the first one past ``step`` (or one cut
        short by a crash) starts what this run writes again. The moved records are written
        before this file is replaced, atomically: a crash here loses nothing."""
        if not self._append or not self.path.exists():
            return None
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        cut = next((i for i, line in enumerate(lines) if _past(line, step)), len(lines))
        if cut == len(lines):
            return None
        aside = free_name(self.path, "superseded")
        kept = self.path.with_name(self.path.name + ".tmp")
        try:
            aside.write_text("".join(lines[cut:]), encoding="utf-8")
            kept.write_text("".join(lines[:cut]), encoding="utf-8")
            kept.replace(self.path)
        except OSError as exc:
            for partial in (aside, kept):  # the metrics file itself is as it was
                with contextlib.suppress(OSError):
                    partial.unlink()
            raise self._failed(exc) from None
        return (
            f"note: resuming from step {step}; the {len(lines) - cut} metrics records that the "
            f"earlier attempt wrote after it were moved to {aside}"
        )

    def write(self, record: Mapping[str, Any]) -> None:
        # NaN and inf are written as null: strict JSON readers reject the bare tokens.
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()
        }
        line = (json.dumps(clean) + "\n").encode()
        try:
            if self._fd is None:
                flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
                self._fd = os.open(self.path, flags | (os.O_TRUNC * self._truncate), 0o644)
                self._truncate = False
            written = os.write(self._fd, line)
        except OSError as exc:
            raise self._failed(exc) from None
        if written < len(line):
            # The disk filled up inside the line (a short write): take the part back.
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, os.fstat(self._fd).st_size - written)
            raise self._failed(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))

    def _failed(self, exc: OSError) -> MetricsError:
        return MetricsError(
            f"writing run.metrics {str(self.path)!r} failed ({exc.strerror}): free space on "
            f"its disk or pass another --metrics (the lines written so far are whole)"
        )

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):  # every line went out with its own write
                os.close(fd)


def _past(line: str, step: int) -> bool:
    """Whether a metrics line comes after ``step`` (a line cut short by a crash does)."""
    try:
        record = json.loads(line)
    except ValueError:
        return True
    return (
        isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step
    )
