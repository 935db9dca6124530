"""The expert-parallel all-to-alls of the MoE layers: how many, how large, how long (torch-free).

With ``ep`` ranks sharing the experts of every MoE layer (``pipetrain.parallel.ep``: rank
``j`` of an ep group holds ``n_experts / ep`` of them), each MoE layer runs, per
micro-batch of ``b`` sequences of ``T`` tokens on every rank of the group::

    forward   route -> all-to-all (dispatch: each token to the ranks of its top_k experts)
              -> experts -> all-to-all (combine: their outputs back) -> weighted sum
    backward  the same two in reverse: the outputs' gradients to the experts, the
              inputs' gradients back

so 2 all-to-alls forward and 2 backward, each carrying ``b T top_k`` token vectors of
``C`` numbers per rank (one small all-to-all of the counts per expert, ``ep`` numbers,
is left out). Assumed dropless and balanced: every expert gets the same share of the
assignments, so a rank keeps ``1 / ep`` of its own assignments (those routed to its
experts) and sends the other ``(ep - 1) / ep`` through its link, and receives as many.
Real routing is uneven; the busiest rank then sends and computes more than this.

The all-to-alls sit on the critical path of the layer (the experts wait for the
dispatch, the next layer for the combine), so their time is added to the layer's forward
and to its input-gradient backward (W, the weight gradient, needs none); time is bytes
over the bandwidth of one rank's link, latency left out (as ``sim.tensor_parallel``).
"""

from __future__ import annotations

from pipetrain.errors import InputError
from pipetrain.schedules.execution import Costs
from pipetrain.sim.tensor_parallel import with_tp_time

__all__ = [
    "ALLTOALLS_BACKWARD",
    "ALLTOALLS_FORWARD",
    "ExpertParallelError",
    "alltoall_bytes",
    "ep_sent",
    "ep_time",
    "with_ep_time",
]

ALLTOALLS_FORWARD = 2  # dispatch, combine
ALLTOALLS_BACKWARD = 2  # their gradients, in reverse


class ExpertParallelError(InputError):
    """An expert-parallel degree, bandwidth or size that makes no sense."""


def _check(ep: int) -> None:
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ExpertParallelError(f"ep is {ep!r}: use a whole number >= 1 (--ep)")


def ep_sent(routed_bytes: float, ep: int) -> float:
    """Bytes a rank sends to the others in one all-to-all that carries ``routed_bytes`` of
    its token vectors: the ``(ep - 1) / ep`` of them routed to experts on other ranks."""
    _check(ep)
    if not 0 <= routed_bytes < float("inf"):
        raise ExpertParallelError(
            f"all-to-all of {routed_bytes:g} bytes: give a finite number >= 0 (--ep-bytes)"
        )
    return routed_bytes * (ep - 1) / ep


def alltoall_bytes(
    tokens: float, top_k: int, d_model: int, ep: int, *, number_bytes: int = 4
) -> float:
    """Bytes one rank sends to the others in one all-to-all of one MoE layer, for
    ``tokens`` tokens of its own: ``tokens x top_k x d_model x number_bytes x (ep - 1) / ep``
    (dropless, balanced routing; see the module docstring)."""
    if not 0 <= tokens < float("inf"):
        raise ExpertParallelError(f"all-to-all of {tokens:g} tokens: give a finite number >= 0")
    return ep_sent(tokens * top_k * d_model * number_bytes, ep)


def ep_time(alltoalls: float, sent_bytes: float, bandwidth: float | None) -> float:
    """Seconds (or time units) of ``alltoalls`` all-to-alls in each of which a rank sends
    ``sent_bytes`` through its link at ``bandwidth`` bytes per unit; None: no time."""
    inf = float("inf")
    if not (0 <= sent_bytes < inf and 0 <= alltoalls < inf):
        raise ExpertParallelError(
            f"all-to-all of {sent_bytes:g} bytes x {alltoalls:g}: give finite numbers >= 0 "
            "(--ep-bytes)"
        )
    if bandwidth is None or sent_bytes * alltoalls == 0:
        return 0.0
    if not 0 < bandwidth < inf:
        raise ExpertParallelError(
            f"bandwidth is {bandwidth}: give a positive, finite number of bytes per time "
            "unit (--ep-bandwidth)"
        )
    return alltoalls * sent_bytes / bandwidth


def with_ep_time(costs: Costs, seconds: float, share: float) -> Costs:
    """``costs`` (one rank's share of the model per micro-batch) with ``seconds`` of
    all-to-alls added to every F, B and I (W has none): the same path as the tensor-parallel
    collectives, so the same addition (``sim.tensor_parallel.with_tp_time``)."""
    return with_tp_time(costs, seconds, share)
