"""The base of every bad-input error in pipetrain (torch-free).

Any exception deriving from ``InputError`` carries a one-line message that names the
problem and the fix; the CLI prints it and exits with status 2. Library users can catch
it to tell their own mistakes apart from bugs.
"""

from __future__ import annotations

__all__ = ["InputError", "RunFailed"]


class InputError(ValueError):
    """Bad input (config, CLI, schedule, checkpoint): one line naming the problem and the fix."""


class RunFailed(RuntimeError):
    """A run that failed for a reason that is neither bad input nor a bug (the loss
    diverged, say): one line naming it, exit status 1."""
