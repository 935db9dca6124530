"""Checkpoint errors: every one is an ``InputError`` (one line, exit status 2 at the CLI)."""

from __future__ import annotations

from pipetrain.errors import InputError

__all__ = ["CheckpointCorruptError", "CheckpointError", "CheckpointIncompatibleError"]


class CheckpointError(InputError):
    """A checkpoint that cannot be saved or loaded: the message names the path and the fix."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint whose files do not match its manifest (flipped byte, missing file)."""


class CheckpointIncompatibleError(CheckpointError):
    """A checkpoint from another format version or for a model of another shape."""
