"""The one error type the CLI turns into a one-line message and exit status 2."""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(Exception):
    """Bad input from the user: the message names the problem and the fix, in one line."""
