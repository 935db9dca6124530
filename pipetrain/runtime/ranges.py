"""Named profiler ranges around a rank's actions, for the steps a caller profiles.

``Pipeline.step(ranges=True)`` runs that step's actions through handlers wrapped here:
each action inside ``torch.profiler.record_function`` (a range in torch.profiler's trace)
and, on CUDA, an NVTX range (Nsight Systems), both named by ``range_name``
(``F stage 1 mb 3``, ``SEND_B stage 2 mb 0``, ``ALLREDUCE stage 1``). A step without
ranges runs the plain table: the wrapping is never consulted, so it costs nothing.
``parse_range_name`` reads a name back (pipetrain.diagnose.profile merges the ranks'
traces by it).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch
from torch.profiler import record_function

from pipetrain.schedules import Action, Kind

__all__ = ["parse_range_name", "range_name", "ranged_handlers"]

Handler = Callable[[Action], bool]

_NAME = re.compile(r"^([A-Z_]+) stage (\d+)(?: mb (\d+))?$")


def range_name(action: Action) -> str:
    """``F stage 1 mb 3``: the kind, the global stage and the micro-batch (when it has one)."""
    mb = "" if action.microbatch is None else f" mb {action.microbatch}"
    return f"{action.kind.value} stage {action.stage}{mb}"


def parse_range_name(name: str) -> Action | None:
    """The action a range is named after, or None for any other range (an operator's)."""
    match = _NAME.match(name)
    if match is None:
        return None
    kind_text, stage, mb = match.groups()
    try:
        return Action(int(stage), Kind(kind_text), None if mb is None else int(mb))
    except ValueError:
        return None


def ranged_handlers(
    actions: Sequence[Action], handlers: Sequence[Handler], *, nvtx: bool
) -> tuple[Handler, ...]:
    """``handlers`` (one per action), each running inside a range named after its action.

    ``nvtx``: also push an NVTX range (CUDA builds; Nsight shows them).
    """
    return tuple(_ranged(h, range_name(a), nvtx) for a, h in zip(actions, handlers, strict=True))


def _ranged(handler: Handler, name: str, nvtx: bool) -> Handler:
    if not nvtx:

        def run(action: Action) -> bool:
            with record_function(name):
                return handler(action)

        return run

    def run_nvtx(action: Action) -> bool:
        torch.cuda.nvtx.range_push(name)  # type: ignore[no-untyped-call]
        try:
            with record_function(name):
                return handler(action)
        finally:
            torch.cuda.nvtx.range_pop()  # type: ignore[no-untyped-call]

    return run_nvtx
