"""The base of every bad-input error in pipetrain (torch-free).

Any exception deriving from ``InputError`` carries a one-line message that names the
problem and the fix; the CLI prints it and exits with status 2. Library users can catch
it to tell their own mistakes apart from bugs.
"""

from __future__ import annotations

from typing import TypeVar

__all__ = ["InputError", "RunFailed", "on_every_rank", "raised_on_every_rank"]


class InputError(ValueError):
    """Bad input (config, CLI, schedule, checkpoint): one line naming the problem and the fix."""


class RunFailed(RuntimeError):
    """A run that failed for a reason that is neither bad input nor a bug (the loss
    diverged, say): one line naming it, exit status 1."""


_E = TypeVar("_E", bound=BaseException)


def on_every_rank(exc: _E) -> _E:
    """Mark ``exc`` as raised alike by every rank of a run (a decision the ranks made
    together: a broadcast manifest, gathered data). Under torchrun only the first rank of
    each node prints it (each node has its log); the others exit with the same status
    quietly, so that a log holds it once rather than once per rank."""
    exc.__dict__["on_every_rank"] = True
    return exc


def raised_on_every_rank(exc: BaseException) -> bool:
    """Whether ``on_every_rank`` marked ``exc``."""
    return bool(exc.__dict__.get("on_every_rank", False))
