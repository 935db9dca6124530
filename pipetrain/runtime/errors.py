"""Errors of the runtime: bad input (an ``InputError``) and failures of a running pipeline.

A failure of a running pipeline names the rank, the action, the peer and the step, so that
the log of every surviving rank points at the one that broke. Collectives outside the
pipeline's own waits (the trainer's stop flag, a checkpoint, the sample's gathered weights,
the process group's set-up) fail with torch's or gloo's own exception; ``lost_peer_error``
turns such a failure into a ``PipelineError`` of one line that says where it happened.
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType

import torch.distributed as dist

from pipetrain.errors import InputError

__all__ = ["PipelineError", "PipelineInputError", "StageMismatchError", "lost_peer_error"]


class PipelineInputError(InputError):
    """Arguments that no pipeline can run with (batch size, split, schedule, device)."""


class StageMismatchError(InputError):
    """Two neighbouring stages disagree about what travels between them."""


class PipelineError(RuntimeError):
    """A running pipeline failed: a timeout, a lost peer, a collective that broke."""


# What gloo's transport and torch's store say when a peer is gone or silent. gloo raises a
# plain RuntimeError (not a DistError) whose text starts with its source file.
_LOST = ("Connection closed by peer", "Connection reset by peer", "pair closure")
_SILENT = ("Timed out", "timed out", "Timeout", "wait timeout")
_GLOO = "gloo/transport"

_PACKAGE = Path(__file__).resolve().parent.parent  # .../pipetrain


def lost_peer_error(
    exc: BaseException, *, rank: int, timeout_s: float, step: str = ""
) -> PipelineError | None:
    """A one-line ``PipelineError`` for a collective that failed because of a peer, or None.

    None for anything else (a bug keeps its traceback). The line names this rank, the
    pipetrain function that waited (after ``step``, e.g. "training step 3", when known)
    and what happened to the peer; gloo does not say which peer, so the line points at
    the other ranks' logs.
    """
    if isinstance(exc, PipelineError):
        return exc
    text = str(exc)
    is_dist = isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and _GLOO in text)
    if not is_dist:
        return None
    if any(s in text for s in _LOST):
        what = (
            "a peer was lost (its process died or closed the connection; the first rank to "
            "fail names the cause in its log)"
        )
    elif any(s in text for s in _SILENT):
        what = (
            f"a peer did not answer within {timeout_s:g} s (it is stopped, hung or was never "
            f"started; raise pipeline.timeout_s if it is just slow)"
        )
    else:
        first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        what = f"{type(exc).__name__}: {first}"
    when = f"{step}, " if step else ""
    return PipelineError(
        f"rank {rank}: {when}waiting on other ranks in {_where(exc.__traceback__)}: {what}"
    )


def _where(tb: TracebackType | None) -> str:
    """The innermost pipetrain function of a traceback, as ``name (path:line)``."""
    found = "a torch.distributed call"
    while tb is not None:
        code = tb.tb_frame.f_code
        path = Path(code.co_filename).resolve()
        if path.is_relative_to(_PACKAGE) and path != Path(__file__).resolve():
            relative = path.relative_to(_PACKAGE.parent).as_posix()
            name = getattr(code, "co_qualname", code.co_name)  # co_qualname: Python 3.11
            found = f"{name} ({relative}:{tb.tb_lineno})"
        tb = tb.tb_next
    return found
