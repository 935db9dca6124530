"""The checkpoints of a directory: ``step_NNNNNN`` (complete, renamed into place) and
``step_NNNNNN.tmp-<nonce>`` (a save that did not finish), and which one to resume from."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from pipetrain.checkpoint.manifest import verify_checkpoint

__all__ = [
    "CheckpointList",
    "ResumeChoice",
    "choose_resume",
    "list_checkpoints",
    "log",
    "step_dir_name",
]

log = logging.getLogger("pipetrain.checkpoint")


_NAME = re.compile(r"^step_(\d+)$")
_TMP = re.compile(r"^step_(\d+)\.tmp-[0-9a-f]+$")


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


@dataclass(frozen=True)
class CheckpointList:
    complete: tuple[tuple[int, Path], ...]  # (step, path), oldest first
    partial: tuple[Path, ...]  # leftovers of saves that did not finish


@dataclass(frozen=True)
class ResumeChoice:
    path: Path | None  # the newest valid checkpoint; None when there is none
    skipped: tuple[str, ...]  # one line per newer checkpoint that failed verification


def list_checkpoints(root: Path | str) -> CheckpointList:
    root = Path(root)
    complete: list[tuple[int, Path]] = []
    partial: list[Path] = []
    if root.is_dir():
        for entry in root.iterdir():
            if not entry.is_dir():
                continue
            if match := _NAME.match(entry.name):
                complete.append((int(match.group(1)), entry))
            elif _TMP.match(entry.name):
                partial.append(entry)
    return CheckpointList(tuple(sorted(complete)), tuple(sorted(partial)))


def choose_resume(root: Path | str, *, checksums: bool = True) -> ResumeChoice:
    """The newest checkpoint under ``root`` that verifies; newer ones that do not are
    reported (and logged) as skipped, as are partial saves."""
    found = list_checkpoints(root)
    for path in found.partial:
        log.warning("ignoring %s: an unfinished save (the process stopped during it)", path)
    skipped: list[str] = []
    for _, path in reversed(found.complete):
        verification = verify_checkpoint(path, checksums=checksums)
        if verification.ok:
            if skipped:
                log.warning("falling back to %s, the newest valid checkpoint", path)
            return ResumeChoice(path, tuple(skipped))
        line = f"skipping {path}: {verification.problems[0]}"
        log.warning("%s", line)
        skipped.append(line)
    return ResumeChoice(None, tuple(skipped))
