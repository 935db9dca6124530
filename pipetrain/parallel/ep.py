"""Expert parallelism: the experts of every MoE layer sharded over an expert-parallel group.

The ep group lies inside the data-parallel dimension, as in Megatron-Core and DeepSpeed:
the dp ranks of one pipeline rank (and tp rank) form ``dp / ep`` groups of ``ep``
neighbours (``dp_rank // ep``), and rank ``j`` of a group holds experts ``[j * E/ep,
(j + 1) * E/ep)`` of every MoE layer of its stages. Dense parameters stay replicated over
all dp ranks; each expert is replicated over the ``dp / ep`` ranks with the same
``dp_rank % ep`` (its "expert replicas").

Tokens go to their experts and back by two all-to-alls per MoE layer and micro-batch
(torch.distributed's ``all_to_all_single`` with split sizes, differentiable through
``torch.distributed.nn``), after one small all-to-all of the counts per expert, so routing
is dropless with variable split sizes. Every replica runs the same schedule, so the
replicas of a group reach each layer's all-to-all in the same order.

Gradients: an expert's gradient on its holder already sums the contributions of every
token of its ep group (the backward all-to-all brings them back); the mean over all dp
replicas is then the sum over the expert replicas divided by dp (``ExpertGradients``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from pipetrain.config.schema import ConfigError
from pipetrain.models.moe import MoEFeedForward, moe_layers, run_experts
from pipetrain.parallel.mesh import Mesh

__all__ = [
    "ExpertGradients",
    "ExpertGroups",
    "expert_groups",
    "expert_parameters",
    "shard_experts",
]


@dataclass(frozen=True)
class ExpertGroups:
    """This process's expert-parallel group and the replicas of its experts."""

    ep: int
    ep_rank: int
    group: Any  # the ep ranks that exchange tokens
    replicas: int  # dp / ep: how many ranks hold each expert
    replica_group: Any  # the ranks that hold the same experts; None when replicas == 1
    replica_index: int  # which of them this rank is (0: counts expert norms)


def expert_groups(mesh: Mesh, ep: int) -> ExpertGroups:
    """Build the ep and expert-replica groups of ``mesh`` (collective: every rank calls it)."""
    pp, dp, tp = mesh.pp, mesh.dp, mesh.tp

    def rank_of(p: int, d: int, t: int) -> int:
        return (p * dp + d) * tp + t

    mine_ep: Any = None
    mine_rep: Any = None
    # Every process creates every group, in one order (dist.new_group is collective).
    for p in range(pp):
        for t in range(tp):
            for g in range(dp // ep):
                ranks = [rank_of(p, g * ep + j, t) for j in range(ep)]
                group = dist.new_group(ranks)
                if mesh.rank in ranks:
                    mine_ep = group
            for j in range(ep):
                ranks = [rank_of(p, g * ep + j, t) for g in range(dp // ep)]
                group = dist.new_group(ranks) if len(ranks) > 1 else None
                if mesh.rank in ranks:
                    mine_rep = group
    return ExpertGroups(ep, mesh.dp_rank % ep, mine_ep, dp // ep, mine_rep, mesh.dp_rank // ep)


class _AllToAllDispatch:
    """Sorted tokens to the ep ranks that hold their experts, through them, and back."""

    def __init__(self, groups: ExpertGroups, n_experts: int) -> None:
        self.groups = groups
        self.per_rank = n_experts // groups.ep

    def __call__(
        self, tokens: torch.Tensor, counts: torch.Tensor, layer: MoEFeedForward
    ) -> torch.Tensor:
        ep, per = self.groups.ep, self.per_rank
        # What every rank sends to each of this rank's experts: (ep sources, per experts).
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.groups.group)
        send = counts.view(ep, per).sum(1).tolist()
        from_each = received_counts.view(ep, per)
        recv = from_each.sum(1).tolist()
        arrived = _exchange(tokens, recv, send, self.groups.group)
        # Arrived by source, then by expert; the experts want theirs together.
        by_expert = _source_major_to_expert_major(from_each)
        outputs = run_experts(
            layer.experts, arrived[by_expert], from_each.sum(0).tolist(), self.groups.ep_rank * per
        )
        back = torch.empty_like(outputs).index_copy(0, by_expert, outputs)
        return _exchange(back, send, recv, self.groups.group)


def _exchange(rows: torch.Tensor, receive: list[int], send: list[int], group: Any) -> torch.Tensor:
    """All-to-all of ``rows``: ``send[j]`` rows to rank j, ``receive[j]`` from it; its
    backward is the reverse exchange of the gradients (torch's functional collective)."""
    # The result waits for the collective when it is first used.
    out: torch.Tensor = all_to_all_single_autograd(rows.contiguous(), receive, send, group)
    return out


def _source_major_to_expert_major(counts: torch.Tensor) -> torch.Tensor:
    """For rows laid out by (source, expert) with ``counts`` (sources, experts), the row
    indices that lay them out by (expert, source)."""
    sizes = counts.reshape(-1)
    starts = (sizes.cumsum(0) - sizes).view_as(counts)
    pieces = [
        torch.arange(int(starts[s, e]), int(starts[s, e] + counts[s, e]), device=counts.device)
        for e in range(counts.shape[1])
        for s in range(counts.shape[0])
    ]
    return torch.cat(pieces) if pieces else counts.new_zeros(0)


def shard_experts(modules: Sequence[nn.Module], groups: ExpertGroups) -> None:
    """Route the MoE layers of ``modules`` (built with this rank's experts only,
    ``model_spec(expert_shard=...)``) through the ep group."""
    for module in modules:
        for name, layer in moe_layers(module):
            if len(layer.experts) * groups.ep != layer.n_experts:
                raise ConfigError(
                    f"{name} holds {len(layer.experts)} of {layer.n_experts} experts, not "
                    f"1/{groups.ep}: build the stage with model_spec(expert_shard=...)"
                )
            layer.dispatch = _AllToAllDispatch(groups, layer.n_experts)


def expert_parameters(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    """The routed experts' parameters of ``modules`` (not the router, not shared experts)."""
    found: list[nn.Parameter] = []
    for module in modules:
        for _, layer in moe_layers(module):
            found.extend(layer.experts.parameters())
    return found


class ExpertGradients:
    """The experts' gradients under expert parallelism: summed over the expert replicas
    and divided by dp, which is their mean over every data-parallel replica."""

    def __init__(self, groups: ExpertGroups, dp: int) -> None:
        self.groups = groups
        self.dp = dp

    def reduce(self, params: Sequence[nn.Parameter]) -> None:
        """Sum over the expert replicas, divide by dp. An expert that no replica routed a
        token to keeps no gradient (None), as in one process, so that the optimizer leaves
        it alone instead of decaying it with a zero gradient."""
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        used = torch.tensor([float(p.grad is not None) for p in params], dtype=grads[0].dtype)
        flat = torch.cat([g.reshape(-1) for g in grads] + [used.to(grads[0].device)])
        if self.groups.replica_group is not None:
            dist.all_reduce(flat, group=self.groups.replica_group)
        flat[: -len(params)].div_(self.dp)
        offset = 0
        for p, g, anyone in zip(params, grads, flat[-len(params) :].tolist(), strict=True):
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
            p.grad = g if anyone else None
