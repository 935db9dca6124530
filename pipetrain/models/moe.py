"""Mixture-of-experts feed-forward for the Llama block (Mixtral, DeepSeek-V3 style).

A linear router scores every token against every expert (softmax, or sigmoid as in
DeepSeek-V3), each token goes to its ``top_k`` experts, and their SwiGLU outputs are
summed with the router's weights (renormalised over the chosen experts when
``router_norm_topk``). Optional shared experts see every token. Routing is dropless
unless ``capacity_factor`` > 0: then each expert takes at most
``ceil(capacity_factor * tokens * top_k / n_experts)`` of a micro-batch's assignments, in
token order, and the rest are dropped (they contribute zero) and counted.

Balancing, two ways (both may be on):

- the Switch/GShard auxiliary loss ``n_experts * sum_i f_i * P_i`` (f_i: the fraction of
  the micro-batch's assignments routed to expert i, P_i: its mean router probability),
  weighted by ``aux_loss_coef``. It enters the backward through ``_AuxLoss``, an identity
  on the layer's output whose backward also hands the loss its gradient, on the scale of
  the main loss (``pipetrain.models.loss_scale``): each micro-batch's auxiliary loss is
  weighted by its tokens over the batch's count of targets, so the term is a mean over
  the batch like the cross-entropy, whatever the number of micro-batches.
- DeepSeek-V3's auxiliary-loss-free bias: a per-expert buffer added to the scores for the
  choice only (not to the weights), moved by ``bias_update_rate`` toward balance after
  every optimizer step from the step's loads (``update_bias``).

What each training micro-batch routed (the auxiliary loss, tokens per expert, dropped
assignments) is recorded when its backward runs, exactly once per micro-batch even when
the forward is recomputed, and taken by the trainer with ``take_records``.

Experts may live on other ranks (expert parallelism): ``dispatch`` runs the sorted tokens
through the experts wherever they are (``pipetrain.parallel.ep`` replaces the local one
with all-to-all); a layer holds only the experts named in ``experts``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.models.config import ModelConfig
from pipetrain.models.init import BASE_STD, layer_generator, normal_, residual_std
from pipetrain.models.loss_scale import loss_divisor

__all__ = ["Dispatch", "Expert", "MoEFeedForward", "RoutingRecord", "moe_layers", "run_experts"]


class Expert(nn.Module):
    """One SwiGLU expert: ``w2(silu(w1 x) * w3 x)`` (Mixtral's names)."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def init_weights(self, generator: torch.Generator, out_std: float) -> None:
        normal_(self.w1.weight, BASE_STD, generator)
        normal_(self.w3.weight, BASE_STD, generator)
        normal_(self.w2.weight, out_std, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


@dataclass(frozen=True)
class RoutingRecord:
    """One training micro-batch through one MoE layer (tensors, detached, not synced)."""

    aux: torch.Tensor  # 0-d: the unweighted auxiliary loss of the micro-batch
    weight: float  # its tokens over the batch's divisor: sum(aux * weight) is a batch mean
    counts: torch.Tensor  # (n_experts,) assignments routed to each expert, before drops
    dropped: torch.Tensor  # 0-d: assignments dropped for capacity


class Dispatch(Protocol):
    def __call__(
        self, tokens: torch.Tensor, counts: torch.Tensor, layer: MoEFeedForward
    ) -> torch.Tensor:
        """The experts' outputs for ``tokens`` sorted by expert, ``counts`` per expert."""
        ...


def run_experts(
    experts: nn.ModuleDict, tokens: torch.Tensor, counts: Sequence[int], first: int
) -> torch.Tensor:
    """Experts ``first``, ``first + 1``, ... on consecutive runs of ``tokens`` of ``counts``."""
    outputs = []
    for j, chunk in enumerate(torch.split(tokens, list(counts))):
        if chunk.shape[0]:
            outputs.append(experts[str(first + j)](chunk))
    if not outputs:
        # No token for any of these experts: an empty slice of the input keeps the result in
        # the autograd graph, so that the backward still runs the exchanges that brought the
        # tokens here (under expert parallelism every rank of the group must take part).
        return tokens[:0]
    return torch.cat(outputs)


def _local_dispatch(
    tokens: torch.Tensor, counts: torch.Tensor, layer: MoEFeedForward
) -> torch.Tensor:
    return run_experts(layer.experts, tokens, counts.tolist(), 0)


class _AuxLoss(torch.autograd.Function):
    """Identity on ``out``; in backward, ``aux`` gets the gradient ``scale`` and the layer
    records the micro-batch (once, even when the forward was recomputed)."""

    @staticmethod
    def forward(
        ctx: Any, out: torch.Tensor, aux: torch.Tensor, scale: float, record: Any
    ) -> torch.Tensor:
        ctx.scale = scale
        ctx.record = record
        ctx.aux_shape = aux.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        layer, entry = ctx.record
        layer._records.append(entry)
        aux_grad = torch.full(ctx.aux_shape, ctx.scale, dtype=torch.float32, device=grad.device)
        return grad, aux_grad, None, None


class MoEFeedForward(nn.Module):
    """Router, experts (this rank's: ``experts``, all by default) and shared experts."""

    def __init__(self, config: ModelConfig, experts: Sequence[int] | None = None) -> None:
        super().__init__()
        self.n_experts = config.n_experts
        self.top_k = config.top_k
        self.router = config.router
        self.norm_topk = config.router_norm_topk
        self.aux_coef = config.aux_loss_coef
        self.capacity_factor = config.capacity_factor
        self.bias_rate = config.bias_update_rate
        self.out_std = residual_std(config.n_layers)
        held = range(config.n_experts) if experts is None else experts
        self.gate = nn.Linear(config.d_model, config.n_experts, bias=False)
        self.experts = nn.ModuleDict(
            {str(e): Expert(config.d_model, config.expert_hidden) for e in held}
        )
        self.shared = (
            Expert(config.d_model, config.expert_hidden * config.n_shared_experts)
            if config.n_shared_experts
            else None
        )
        if self.bias_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(config.n_experts))
        else:
            self.expert_bias: torch.Tensor | None = None
        self.dispatch: Dispatch = _local_dispatch
        self._records: list[RoutingRecord] = []

    def init_weights(self, generator: torch.Generator) -> None:
        """The router and shared experts from ``generator``; each expert from a generator
        of its own, so an expert's weights do not depend on which others this rank holds."""
        normal_(self.gate.weight, BASE_STD, generator)
        if self.shared is not None:
            self.shared.init_weights(generator, self.out_std)
        base = generator.initial_seed()
        for name, expert in self.experts.items():
            assert isinstance(expert, Expert)
            expert.init_weights(layer_generator(base, int(name)), self.out_std)
        if self.expert_bias is not None:
            self.expert_bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        n, k = tokens.shape[0], self.top_k
        scores = self._scores(tokens)
        with torch.no_grad():
            choice = scores if self.expert_bias is None else scores + self.expert_bias
            top = choice.topk(k, dim=-1).indices  # (N, k)
        weights = scores.gather(-1, top)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        flat = top.reshape(-1)
        order = flat.argsort(stable=True)  # assignments by expert, in token order within one
        counts = torch.bincount(flat, minlength=self.n_experts)
        kept, kept_counts = self._capacity(order, flat, counts, n)
        routed = self.dispatch(tokens[kept // k], kept_counts, self)
        combined = routed.new_zeros(n * k, routed.shape[-1]).index_copy(0, kept, routed)
        out = (combined.view(n, k, -1) * weights.unsqueeze(-1).to(routed.dtype)).sum(1)
        if self.shared is not None:
            out = out + self.shared(tokens)
        out = out.view(x.shape).to(x.dtype)
        if not torch.is_grad_enabled():
            return out
        return self._with_aux_loss(out, scores, counts, kept_counts, n)

    def _scores(self, tokens: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.gate(tokens).float()  # routing in float32, as Mixtral does
        return logits.softmax(-1) if self.router == "softmax" else logits.sigmoid()

    def _capacity(
        self, order: torch.Tensor, flat: torch.Tensor, counts: torch.Tensor, n: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The assignments kept (indices into the flat (N * k) list, by expert) and the
        kept count of each expert."""
        if self.capacity_factor <= 0:
            return order, counts
        capacity = math.ceil(self.capacity_factor * n * self.top_k / self.n_experts)
        starts = counts.cumsum(0) - counts
        position = torch.arange(order.numel(), device=order.device) - starts[flat[order]]
        return order[position < capacity], counts.clamp(max=capacity)

    def _with_aux_loss(
        self,
        out: torch.Tensor,
        scores: torch.Tensor,
        counts: torch.Tensor,
        kept_counts: torch.Tensor,
        n: int,
    ) -> torch.Tensor:
        probs = scores if self.router == "softmax" else scores / scores.sum(-1, keepdim=True)
        fraction = counts.to(torch.float32) / (n * self.top_k)
        aux = self.n_experts * (fraction * probs.mean(0)).sum()
        divisor = loss_divisor() or float(n)
        entry = RoutingRecord(
            aux.detach(), n / divisor, counts.detach(), (counts - kept_counts).sum().detach()
        )
        result: torch.Tensor = _AuxLoss.apply(out, aux, self.aux_coef * n / divisor, (self, entry))  # type: ignore[no-untyped-call]
        return result

    def take_records(self) -> list[RoutingRecord]:
        """The micro-batches recorded since the last call (their backward ran)."""
        records, self._records = self._records, []
        return records

    @torch.no_grad()
    def update_bias(self, loads: torch.Tensor) -> None:
        """DeepSeek-V3's balancing step: each expert's bias up by the rate when it got
        fewer than the mean of ``loads`` (the step's tokens per expert, over every
        replica), down when more."""
        if self.expert_bias is None:
            return
        loads = loads.to(self.expert_bias.device, torch.float32)
        self.expert_bias.add_(self.bias_rate * torch.sign(loads.mean() - loads))


def moe_layers(module: nn.Module) -> list[tuple[str, MoEFeedForward]]:
    """The MoE feed-forwards in ``module`` with their global names (``layers.3.moe``)."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, MoEFeedForward)]
