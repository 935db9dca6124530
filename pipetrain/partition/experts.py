"""What a mixture-of-experts feed-forward counts: parameters, FLOPs, saved activations.

The MoE feed-forward of a Llama block (``pipetrain.models.moe``) in place of its dense
SwiGLU: a router ``gate`` (C x E), ``n_experts`` routed SwiGLU experts of ``expert_hidden``
units (3 C F_e each), and ``n_shared_experts`` shared ones that every token passes (one
SwiGLU of ``n_shared x F_e`` units). A token uses the router, its ``top_k`` experts and the
shared ones: those are its active parameters, and its matmul FLOPs are twice them.

Under expert parallelism a rank holds ``n_experts / ep`` of the routed experts and the
router and shared experts whole; under tensor parallelism the whole feed-forward is on
every tp rank (``pipetrain.parallel.tp`` shards attention only in a MoE block). With
balanced routing a rank of an ep group computes ``top_k`` assignments per token of its
own micro-batch whatever ``ep`` is, so FLOPs and activations per rank do not change
with ``ep``. Torch-free; the formulas are docs/memory_model.md's.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipetrain.models.config import ModelConfig

__all__ = ["MoeCounts", "moe_activation_numbers", "moe_counts"]


@dataclass(frozen=True)
class MoeCounts:
    """Parameters of one MoE feed-forward (the block's attention and norms not included)."""

    router: int  # the gate: C x E
    expert: int  # one routed expert: 3 C F_e
    shared: int  # the shared experts together: 3 C F_e n_shared
    n_experts: int
    top_k: int

    def held(self, ep: int = 1) -> int:
        """Parameters on one of ``ep`` expert-parallel ranks: its ``n_experts / ep``
        routed experts, the router and the shared experts."""
        return self.router + self.shared + self.expert * (self.n_experts // ep)

    @property
    def total(self) -> int:
        return self.held(1)

    @property
    def active(self) -> int:
        """Parameters one token's forward uses: the router, top_k experts, the shared ones."""
        return self.router + self.shared + self.top_k * self.expert


def moe_counts(config: ModelConfig) -> MoeCounts:
    """The MoE feed-forward of ``config`` (which must have experts)."""
    d, f = config.d_model, config.expert_hidden
    return MoeCounts(
        router=d * config.n_experts,
        expert=3 * d * f,
        shared=3 * d * f * config.n_shared_experts,
        n_experts=config.n_experts,
        top_k=config.top_k,
    )


def moe_activation_numbers(config: ModelConfig) -> int:
    """Numbers (fp32 slots; an int64 index counts 2) the MoE feed-forward keeps for its
    backward per token, beyond its input (the norm's output, counted with the block).

    Counted from what autograd saves in ``MoEFeedForward.forward`` (dropless):

    - the router's scores, E (softmax or sigmoid keep their output); a sigmoid router's
      normalisation for the auxiliary loss keeps one sum per token;
    - the gather of the chosen scores keeps its k indices (int64), the renormalisation
      (``router_norm_topk``) the k scores and their sum, the weighted sum the k weights;
    - the tokens gathered for the experts, k C (kept by w1 and w3), and the gather's and
      the scatter back's indices (two int64 lists of k);
    - inside the experts, per assignment, SwiGLU's 4 F_e (w1's and w3's outputs, the
      SiLU, their product); the shared experts 4 F_e n_shared per token;
    - the experts' outputs, k C, kept twice: joined (by the scatter back into token order,
      whose backward shapes its gradient like them) and scattered (by the multiplication
      with the router weights).
    """
    d, f, k, e = config.d_model, config.expert_hidden, config.top_k, config.n_experts
    router = e + (1 if config.router == "sigmoid" else 0)
    weights = 2 * k + k + ((k + 1) if config.router_norm_topk else 0)
    dispatch = k * d + 2 * (2 * k)
    experts = 4 * k * f + 4 * f * config.n_shared_experts
    combine = 2 * k * d
    return router + weights + dispatch + experts + combine
