"""The tensor-parallel collectives inside a stage: how many, how large, how long (torch-free).

With ``tp`` ranks sharing every layer the Megatron way (``pipetrain.parallel.tp``), each
transformer block runs, per micro-batch of ``b`` sequences of ``T`` tokens::

    forward   x -> [norm] -> q,k,v (column) -> attn -> wo (row) -> all-reduce (b, T, C)
                -> [norm] -> gate,up (column) -> act -> down (row) -> all-reduce (b, T, C)
    backward  the same two all-reduces, of the input gradients of the column-wise linears

so 2 all-reduces of a (b, T, C) activation forward and 2 backward. With sequence
parallelism each all-reduce becomes a reduce-scatter (after the row-wise linear) and an
all-gather (before the next column-wise one): the same bytes through every link. The
embedding (split over the vocabulary) adds its lookup's partial sums: one all-reduce
forward (a reduce-scatter with sequence parallelism); the head (split over the
vocabulary, logits kept sharded) gathers its input forward only with sequence
parallelism, and all-reduces its input gradient backward (a reduce-scatter with sequence
parallelism). The loss's own reductions over the vocabulary are (b, T) numbers, left out.
A mixture-of-experts block shards its attention only (its router and experts are whole
on every tp rank, ``pipetrain.parallel.tp``): one all-reduce forward and one backward
(``MOE_TP``); sequence parallelism is not supported with it.

A ring all-reduce of ``n`` bytes over ``tp`` ranks moves ``2 (tp - 1) / tp * n`` bytes
through every rank's link; an all-gather or reduce-scatter half that. These collectives
sit on the critical path of the layer (the next matmul needs their result), so their time
is added to the layer's forward and backward; latency is left out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipetrain.errors import InputError
from pipetrain.schedules.execution import Costs

__all__ = [
    "MOE_TP",
    "TensorParallelError",
    "TpCollectives",
    "layer_collectives",
    "tp_time",
    "tp_traffic",
    "with_tp_time",
]


class TensorParallelError(InputError):
    """A tensor-parallel degree, bandwidth or size that makes no sense."""


@dataclass(frozen=True)
class TpCollectives:
    """One layer's tp collectives for one micro-batch, in all-reduces of one (b, T, C)
    activation each (an all-gather or reduce-scatter counts a half: the same traffic)."""

    forward: float
    backward: float

    @property
    def total(self) -> float:
        return self.forward + self.backward


_LAYERS = {
    # kind: (without sequence parallelism, with it)
    "block": (TpCollectives(2.0, 2.0), TpCollectives(2.0, 2.0)),
    "embedding": (TpCollectives(1.0, 0.0), TpCollectives(0.5, 0.0)),
    "head": (TpCollectives(0.0, 1.0), TpCollectives(0.5, 0.5)),
}

# A MoE block: attention's all-reduce forward (after wo) and backward (before q, k, v).
MOE_TP = TpCollectives(1.0, 1.0)


def layer_collectives(kind: str, *, sequence_parallel: bool = False) -> TpCollectives:
    """The all-reduce equivalents a layer of ``kind`` ("embedding" | "block" | "head") runs
    per micro-batch under tensor parallelism (see the module docstring)."""
    try:
        plain, sp = _LAYERS[kind]
    except KeyError:
        raise TensorParallelError(
            f"layer kind {kind!r} is unknown: use one of {', '.join(_LAYERS)}"
        ) from None
    return sp if sequence_parallel else plain


def _check(tp: int) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise TensorParallelError(f"tp is {tp!r}: use a whole number >= 1 (--tp)")


def tp_traffic(allreduces: float, activation_bytes: float, tp: int) -> float:
    """Bytes through one rank's link for ``allreduces`` ring all-reduces of
    ``activation_bytes`` each over ``tp`` ranks: ``2 (tp - 1) / tp`` of the bytes each."""
    _check(tp)
    inf = float("inf")
    if not (0 <= activation_bytes < inf and 0 <= allreduces < inf):
        raise TensorParallelError(
            f"tp collective of {activation_bytes:g} bytes x {allreduces:g}: give finite "
            "numbers >= 0 (--tp-bytes)"
        )
    return allreduces * 2.0 * (tp - 1) / tp * activation_bytes


def tp_time(allreduces: float, activation_bytes: float, tp: int, bandwidth: float | None) -> float:
    """Seconds (or time units) of ``allreduces`` all-reduces of ``activation_bytes`` over
    ``tp`` ranks at ``bandwidth`` bytes per unit of one rank's link; None: no time."""
    traffic = tp_traffic(allreduces, activation_bytes, tp)
    if bandwidth is None or traffic == 0:
        return 0.0
    if not 0 < bandwidth < float("inf"):
        raise TensorParallelError(
            f"bandwidth is {bandwidth}: give a positive, finite number of bytes per time "
            "unit (--tp-bandwidth)"
        )
    return traffic / bandwidth


def with_tp_time(costs: Costs, seconds: float, share: float) -> Costs:
    """``costs`` (one rank's share of the model per micro-batch) with ``seconds`` of tp
    collectives added to every F, B and I (the input gradient's all-reduces; W has none).

    One-number costs are the rank's share and get all of it; per-stage tuples are each
    stage's own time and get ``share`` of it (a stage is ``share`` of the rank's share)."""

    def add(value: float | tuple[float, ...]) -> float | tuple[float, ...]:
        if isinstance(value, tuple):
            return tuple(v + seconds * share for v in value)
        return value + seconds

    return replace(
        costs,
        forward=add(costs.forward),
        backward=add(costs.backward),
        backward_input=add(costs.backward_input),
    )
