"""The error type the CLI turns into a one-line message and exit status 2."""

from __future__ import annotations

from pipetrain.errors import InputError

__all__ = ["UsageError"]


class UsageError(InputError):
    """Bad command-line input: the message names the problem and the fix, in one line."""
