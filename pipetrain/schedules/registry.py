"""Every built-in schedule by name, with its constraints checked up front.

``build_schedule("1f1b", pp=4, microbatches=2)`` raises ``ScheduleError`` with
"1f1b needs --microbatches >= --pp (got m=2, p=4): raise --microbatches to 4 or more"
before any generator runs. ``fitting(pp, microbatches)`` lists the names that fit.

``chunks`` (v, stages per rank) is read only by the schedules that take it
(``ScheduleSpec.uses_chunks``: interleaved-1f1b, looped-bfs); the others have a fixed
number of stages per rank (``default_chunks``) and ignore it, so that one ``--chunks``
applies to a comparison of all schedules.

The zero-bubble family and DualPipeV live in modules of their own and are imported only
when built, so that this registry loads even where they are missing.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from pipetrain.schedules.chimera import check_chimera, chimera
from pipetrain.schedules.gpipe import check_gpipe, gpipe
from pipetrain.schedules.interleaved import (
    check_interleaved_1f1b,
    check_looped_bfs,
    interleaved_1f1b,
    looped_bfs,
)
from pipetrain.schedules.naive import check_naive, naive
from pipetrain.schedules.one_f_one_b import check_one_f_one_b, one_f_one_b
from pipetrain.schedules.pipedream import (
    check_pipedream,
    check_pipedream_2bw,
    pipedream,
    pipedream_2bw,
)
from pipetrain.schedules.schedule import Schedule, ScheduleError
from pipetrain.schedules.v_shape import check_v_half, check_v_min, v_half, v_min

__all__ = ["SCHEDULE_NAMES", "ScheduleSpec", "build_schedule", "fitting", "get_spec"]

Check = Callable[[int, int, int], "str | None"]
Builder = Callable[[int, int, int], Schedule]


@dataclass(frozen=True)
class ScheduleSpec:
    """What the registry knows about one schedule family."""

    name: str
    description: str
    placement: str  # Placement.kind of its schedules
    uses_chunks: bool  # True when --chunks (v) changes the schedule
    default_chunks: int  # v when none is given; for the others, their fixed stages per rank
    asynchronous: bool  # weights change inside the step (STEP actions)
    splits_backward: bool  # backward runs as I then W
    # True for naive: it does not micro-batch, so a simulator scales its per-micro-batch
    # costs by the m micro-batches that its single batch stands for.
    whole_batch: bool
    constraint: Check
    builder: Builder

    def chunks(self, chunks: int | None) -> int:
        """The v this schedule uses when asked for ``chunks``."""
        return chunks if self.uses_chunks and chunks is not None else self.default_chunks

    def check(self, p: int, m: int, v: int | None = None) -> str | None:
        """None if (p, m, v) fits, else one line saying why and what to change."""
        return self.constraint(p, m, self.chunks(v))

    def build(self, p: int, m: int, v: int | None = None) -> Schedule:
        problem = self.check(p, m, v)
        if problem is not None:
            raise ScheduleError(problem)
        return self.builder(p, m, self.chunks(v))


def _external(module: str, function: str) -> Builder:
    """A builder imported on first use (modules written alongside this registry)."""

    def build(p: int, m: int, v: int) -> Schedule:
        generator: Callable[[int, int], Schedule] = getattr(
            importlib.import_module(f"pipetrain.schedules.{module}"), function
        )
        return generator(p, m)

    return build


def _by_building(builder: Builder) -> Check:
    """The check of a generator that validates its own arguments: build and report."""

    def check(p: int, m: int, v: int) -> str | None:
        try:
            builder(p, m, v)
        except ScheduleError as exc:
            return str(exc)
        return None

    return check


def _spec(
    name: str,
    description: str,
    placement: str,
    constraint: Check,
    builder: Builder,
    *,
    chunks: int = 1,
    uses_chunks: bool = False,
    asynchronous: bool = False,
    splits_backward: bool = False,
    whole_batch: bool = False,
) -> ScheduleSpec:
    return ScheduleSpec(
        name,
        description,
        placement,
        uses_chunks,
        chunks,
        asynchronous,
        splits_backward,
        whole_batch,
        constraint,
        builder,
    )


def _specs() -> tuple[ScheduleSpec, ...]:
    """Every built-in family, one ``_spec`` entry each, in the order the CLI lists them.

    Long because it is a table, not logic: one entry of about eight lines per family, and
    a reader comparing two families (their placements, chunks, flags) wants them side by
    side in one place. A new family is one more entry here.
    """
    zb_h1 = _external("zero_bubble", "zb_h1")
    zb_h2 = _external("zero_bubble", "zb_h2")
    zb_v = _external("zero_bubble", "zb_v")
    dualpipe_v = _external("dualpipe", "dualpipe_v")
    return (
        _spec(
            "naive",
            "model parallel without micro-batches: one rank busy at a time",
            "linear",
            check_naive,
            lambda p, m, v: naive(p, m),
            whole_batch=True,
        ),
        _spec(
            "gpipe",
            "all forwards, then all backwards",
            "linear",
            check_gpipe,
            lambda p, m, v: gpipe(p, m),
        ),
        _spec(
            "1f1b",
            "one forward, one backward after a warm-up (PipeDream-Flush)",
            "linear",
            check_one_f_one_b,
            lambda p, m, v: one_f_one_b(p, m),
        ),
        _spec(
            "interleaved-1f1b",
            "Megatron's 1F1B over v looped stages per rank, depth first",
            "looped",
            check_interleaved_1f1b,
            interleaved_1f1b,
            chunks=2,
            uses_chunks=True,
        ),
        _spec(
            "looped-bfs",
            "v looped stages per rank, breadth first (GPipe per chunk)",
            "looped",
            check_looped_bfs,
            looped_bfs,
            chunks=2,
            uses_chunks=True,
        ),
        _spec(
            "zb-h1",
            "zero bubble, 1F1B memory: split backward, W fills the gaps",
            "linear",
            _by_building(zb_h1),
            zb_h1,
            splits_backward=True,
        ),
        _spec(
            "zb-h2",
            "zero bubble with more warm-up forwards and twice the memory",
            "linear",
            _by_building(zb_h2),
            zb_h2,
            splits_backward=True,
        ),
        _spec(
            "zb-v",
            "zero bubble on a V placement (two stages per rank)",
            "v",
            _by_building(zb_v),
            zb_v,
            chunks=2,
            splits_backward=True,
        ),
        _spec(
            "dualpipe-v",
            "DualPipe folded onto a V: forward and backward chunks overlap",
            "v",
            _by_building(dualpipe_v),
            dualpipe_v,
            chunks=2,
            splits_backward=True,
        ),
        _spec(
            "v-half",
            "controllable memory on a V: half of 1F1B's activations",
            "v",
            check_v_half,
            lambda p, m, v: v_half(p, m),
            chunks=2,
            splits_backward=True,
        ),
        _spec(
            "v-min",
            "controllable memory on a V: a third of 1F1B's activations, more bubble",
            "v",
            check_v_min,
            lambda p, m, v: v_min(p, m),
            chunks=2,
            splits_backward=True,
        ),
        _spec(
            "chimera",
            "two pipelines in opposite directions, gradients all-reduced",
            "bidirectional",
            check_chimera,
            lambda p, m, v: chimera(p, m),
            chunks=2,
        ),
        _spec(
            "pipedream",
            "asynchronous 1F1B without flush, a weight version per backward",
            "linear",
            lambda p, m, v: check_pipedream(p, m, v),
            lambda p, m, v: pipedream(p, m),
            asynchronous=True,
        ),
        _spec(
            "pipedream-2bw",
            "asynchronous 1F1B, gradients accumulated over m, two weight buffers",
            "linear",
            lambda p, m, v: check_pipedream_2bw(p, m, v),
            lambda p, m, v: pipedream_2bw(p, m),
            asynchronous=True,
        ),
    )


# Read-only: built once at import, never changed.
_SPECS: Mapping[str, ScheduleSpec] = MappingProxyType({spec.name: spec for spec in _specs()})
SCHEDULE_NAMES: tuple[str, ...] = tuple(_SPECS)


def get_spec(name: str) -> ScheduleSpec:
    """The spec of ``name``; an unknown name raises ``ScheduleError`` listing the known."""
    spec = _SPECS.get(name)
    if spec is None:
        raise ScheduleError(f"unknown schedule {name!r}: use one of {', '.join(SCHEDULE_NAMES)}")
    return spec


def build_schedule(name: str, pp: int, microbatches: int, chunks: int | None = None) -> Schedule:
    """Build schedule ``name`` after checking that (pp, microbatches, chunks) fits it."""
    return get_spec(name).build(pp, microbatches, chunks)


def fitting(pp: int, microbatches: int, chunks: int | None = None) -> list[str]:
    """The names of the schedules that fit (pp, microbatches, chunks), in registry order."""
    return [name for name, spec in _SPECS.items() if spec.check(pp, microbatches, chunks) is None]
