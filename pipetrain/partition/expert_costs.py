"""A layout's layer costs at expert-parallel degree ``ep`` from its costs at ep 1, for
``plan --auto``'s search over ep (torch-free).

Under expert parallelism (``pipetrain.parallel.ep``) a rank of an ep group computes as
much as without it (balanced routing: ``pipetrain.partition.experts``), holds
``1 / ep`` of every MoE layer's routed experts, and sends its tokens to their experts and
back by all-to-all. So a layout's costs at ep are its costs at ep 1, measured or
estimated, with two changes that the FLOP estimate knows: each MoE block's all-to-all
time added to its forward and input backward, and its parameters less the experts that
other ranks hold. Taking the difference of two estimates rather than the estimate
itself keeps a profile's measured compute.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pipetrain.models.config import ModelConfig
from pipetrain.partition.estimate import estimate_costs
from pipetrain.partition.layer_costs import LayerCost

__all__ = ["expert_parallel_costs"]


def expert_parallel_costs(
    costs: Sequence[LayerCost],
    config: ModelConfig,
    seq_len: int,
    *,
    tp: int,
    ep: int,
    flops_per_second: float,
    ep_bandwidth: float,
) -> list[LayerCost]:
    """``costs`` (one tp rank's at ep 1, per sample) as one rank of an ep group of ``ep``
    holds and runs them, its all-to-alls at ``ep_bandwidth`` bytes/s."""
    if ep == 1:
        return list(costs)
    one = estimate_costs(config, seq_len, flops_per_second=flops_per_second, tp=tp)
    sharded = estimate_costs(
        config, seq_len, flops_per_second=flops_per_second, tp=tp, ep=ep, ep_bandwidth=ep_bandwidth
    )
    out = []
    for c, a, b in zip(costs, one, sharded, strict=True):
        alltoall_forward = b.forward - a.forward
        alltoall_backward = b.backward_input - a.backward_input
        held = a.params - b.params  # the routed experts the other ep ranks hold
        out.append(
            replace(
                c,
                forward=c.forward + alltoall_forward,
                backward=c.backward + alltoall_backward,
                backward_input=c.backward_input + alltoall_backward,
                params=c.params - held,
                param_bytes=c.param_bytes - (a.param_bytes - b.param_bytes),
            )
        )
    return out
