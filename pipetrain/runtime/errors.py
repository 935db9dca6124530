"""Errors of the runtime: bad input (an ``InputError``) and failures of a running pipeline.

A failure of a running pipeline names the rank, the action, the peer and the step, so that
the log of every surviving rank points at the one that broke.
"""

from __future__ import annotations

from pipetrain.errors import InputError

__all__ = ["PipelineError", "PipelineInputError", "StageMismatchError"]


class PipelineInputError(InputError):
    """Arguments that no pipeline can run with (batch size, split, schedule, device)."""


class StageMismatchError(InputError):
    """Two neighbouring stages disagree about what travels between them."""


class PipelineError(RuntimeError):
    """A running pipeline failed: a timeout, a lost peer, a collective that broke."""
