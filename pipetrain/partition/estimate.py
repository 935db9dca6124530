"""Layer costs from the model's shape alone: parameter counts, FLOPs and saved activations.

Used by ``pipetrain plan`` when nothing is measured (``--balance uniform|params`` and
explicit splits), and for real sizes that do not fit the machine. Times are FLOPs divided by
an assumed throughput, so they rank stages correctly but are only as good as that number.
Torch-free.

With tensor parallelism (``tp`` > 1) every figure is one tp rank's: the matrices of the
blocks, the embedding and the head are split ``tp`` ways, norms and row-wise biases are
whole on every rank; the activations inside attention and the MLP are split, those of the
norms and the residual stream are whole (split over the sequence with
``sequence_parallel``), and the time of the tp collectives at ``tp_bandwidth`` is added to
the layers' forward and backward (``pipetrain.sim.tensor_parallel``). The formula, term by
term, is docs/memory_model.md.

Mixture-of-experts blocks (``pipetrain.partition.experts``) count their router, experts and
shared experts; with expert parallelism (``ep`` > 1) a rank holds ``1 / ep`` of the routed
experts, and the time of the MoE layers' all-to-alls at ``ep_bandwidth`` is added to their
forward and backward (``pipetrain.sim.expert_parallel``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipetrain.models.config import ModelConfig
from pipetrain.partition.balance import LayerCost, PartitionError
from pipetrain.partition.experts import moe_activation_numbers, moe_counts
from pipetrain.sim.expert_parallel import (
    ALLTOALLS_BACKWARD,
    ALLTOALLS_FORWARD,
    alltoall_bytes,
    ep_time,
)
from pipetrain.sim.tensor_parallel import MOE_TP, TpCollectives, layer_collectives, tp_time

__all__ = [
    "DEFAULT_FLOPS",
    "ModelCounts",
    "block_params",
    "check_expert_parallel",
    "check_tensor_parallel",
    "estimate_costs",
    "layer_params",
    "model_counts",
]

# About what 2 CPU cores sustain on small fp32 matmuls (the 6.6 M-parameter reference model
# trains at ~2500 tokens/s: 6 x 6.6e6 x 2500 = 1e11 FLOP/s).
DEFAULT_FLOPS = 1e11
_FP32 = 4


def check_tensor_parallel(
    config: ModelConfig, tp: int, *, seq_len: int, sequence_parallel: bool = False
) -> None:
    """Refuse, in one line, a ``tp`` that the model's sizes cannot be split by (as the
    runtime's ``pipetrain.parallel.tp.check_divisible`` does)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise PartitionError(f"--tp {tp!r}: give a whole number >= 1")
    for what, size in (
        ("n_heads", config.n_heads),
        ("n_kv_heads", config.n_kv_heads),
        ("ffn_hidden", config.ffn_hidden),
        ("vocab_size", config.vocab_size),
    ):
        if size % tp:
            fits = ", ".join(str(n) for n in range(1, size + 1) if size % n == 0 and n <= 64)
            raise PartitionError(
                f"--tp {tp} does not divide the model's {what} = {size}, which tensor "
                f"parallelism splits evenly over the tp ranks: use a --tp that divides it "
                f"({fits}), or --set {what}=..."
            )
    if sequence_parallel and tp > 1:
        if config.n_experts:
            raise PartitionError(
                "--sequence-parallel is not supported with mixture-of-experts blocks (as "
                "pipetrain train refuses it: routing needs the whole sequence): drop "
                "--sequence-parallel"
            )
        if config.family == "gpt2":
            raise PartitionError(
                "--sequence-parallel is not supported with gpt2's learned positions (as "
                "pipetrain train refuses it): drop --sequence-parallel for gpt2 models"
            )
        if seq_len % tp:
            raise PartitionError(
                f"--sequence-parallel splits the {seq_len} tokens of a sequence over --tp "
                f"{tp} ranks: use a --seq-len that is a multiple of {tp}"
            )


def check_expert_parallel(config: ModelConfig, ep: int) -> None:
    """Refuse, in one line, an ``ep`` for a dense model or one that does not divide the
    experts (as ``pipetrain train --ep`` does)."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise PartitionError(f"--ep {ep!r}: give a whole number >= 1")
    if ep == 1:
        return
    if not config.n_experts:
        raise PartitionError(
            f"--ep {ep} shards experts, but model {config.name!r} is dense: pick a MoE model "
            f"(moe-tiny, moe-default, mixtral-8x7b, deepseek-v3) or drop --ep"
        )
    if config.n_experts % ep:
        fits = ", ".join(
            str(n) for n in range(2, config.n_experts + 1) if config.n_experts % n == 0
        )
        raise PartitionError(
            f"model {config.name!r} has {config.n_experts} experts per MoE layer, which do not "
            f"split over --ep {ep} ranks: pick an --ep that divides {config.n_experts} ({fits})"
        )


def layer_params(config: ModelConfig, tp: int = 1) -> tuple[int, int, int]:
    """Parameters of the embedding, of one block, and of the head (its own copy if tied),
    on one of ``tp`` tensor-parallel ranks: matrices and column-wise biases split over
    ``tp``, norms, row-wise biases and GPT-2's position table whole."""
    d, v, f, kv = config.d_model, config.vocab_size, config.ffn_hidden, config.kv_dim
    if config.family == "llama":
        embed = v * d // tp
        # wq, wo: d x d; wk, wv: d x kv; w1, w3, w2: d x f; two RMSNorm weights (whole).
        block = 2 * d + (2 * d * d + 2 * d * kv + 3 * d * f) // tp
        head = d + v * d // tp
    else:
        embed = v * d // tp + config.max_seq_len * d
        # Whole: two LayerNorms (weight, bias) and the biases of wo and proj (row-wise).
        # Split: wq, wk, wv with their biases, wo's weight, fc with its bias, proj's weight.
        block = 2 * 2 * d + 2 * d + (3 * (d * d + d) + d * d + (d * f + f) + f * d) // tp
        head = 2 * d + v * d // tp
    return embed, block, head


def block_params(config: ModelConfig, block: int, tp: int = 1, ep: int = 1) -> int:
    """Parameters of block ``block`` on one tp rank of one of ``ep`` expert-parallel ranks:
    a dense block as ``layer_params``; a MoE block its norms and tp-split attention, and its
    router, shared experts and ``1 / ep`` of the routed experts, whole on every tp rank."""
    dense = layer_params(config, tp)[1]
    if not config.is_moe_block(block):
        return dense
    d, kv = config.d_model, config.kv_dim
    return 2 * d + (2 * d * d + 2 * d * kv) // tp + moe_counts(config).held(ep)


@dataclass(frozen=True)
class ModelCounts:
    """The whole model's parameters: all of them, and those one token's forward uses."""

    total: int  # a tied head counted once
    active: int  # a MoE block's router, top_k and shared experts only; dense: = total
    moe_blocks: int

    @property
    def forward_flops_per_token(self) -> float:
        """Matmul FLOPs of one token's forward, attention's core left out: 2 x active."""
        return 2.0 * self.active


def model_counts(config: ModelConfig) -> ModelCounts:
    """Parameters of ``config``, total and active per token (docs/memory_model.md)."""
    embed, _, head = layer_params(config)
    total = embed + head - (config.vocab_size * config.d_model if config.tie_embeddings else 0)
    active = total
    for i in range(config.n_layers):
        total += block_params(config, i)
        active += block_params(config, i)
        if config.is_moe_block(i):
            moe = moe_counts(config)
            active -= moe.total - moe.active
    return ModelCounts(total, active, len(config.moe_blocks))


def _block_flops(
    config: ModelConfig, seq_len: int, tp: int = 1, moe: bool = False
) -> tuple[float, float]:
    """Forward FLOPs of one block for one sequence on one of ``tp`` ranks: (matmuls with
    weights, attention core). A MoE block's feed-forward multiplies each token with the
    router, its top_k experts and the shared ones, whole on every tp rank."""
    d, f, kv = config.d_model, config.ffn_hidden, config.kv_dim
    proj = d * d + 2 * d * kv + d * d
    mlp = 3 * d * f if config.family == "llama" else 2 * d * f
    whole = 0
    if moe:
        mlp, whole = 0, moe_counts(config).active
    matmul = 2.0 * seq_len * ((proj + mlp) / tp + whole)
    attention = 4.0 * seq_len * seq_len * d  # Q K^T and A V, computed in full by the CPU kernels
    return matmul, attention / tp  # each tp rank its heads and hidden units


def _block_activation_bytes(
    config: ModelConfig,
    seq_len: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    moe: bool = False,
) -> float:
    """Bytes a block keeps for its backward, per sequence, fp32, on one of ``tp`` ranks.

    Counted from what autograd saves in these modules (the profiler's figure for the tiny
    presets, exactly): per token, the residual input, the norm outputs and the views the
    linears keep, q, k, v (k and v at their own width: attention pairs the GQA heads without
    repeating them), the attention output; the MLP's
    hidden tensors (SwiGLU keeps gate, up, their activation and product; GELU keeps two);
    the norm statistics, one log-sum-exp per head (memory-efficient attention keeps no
    T x T matrix), and for Llama one head-width tensor per micro-batch in attention,
    charged here to every sample (so a little high for micro-batches of several samples).

    Under tensor parallelism attention's and the MLP's tensors are split over ``tp`` (heads
    and hidden units are); the norms' (input, normalised, statistics) are whole, or split
    over the sequence with ``sequence_parallel``; the norms' outputs that the column-wise
    linears keep are whole either way (with sequence parallelism they keep the all-gathered
    input). A MoE block keeps its feed-forward's tensors (``moe_activation_numbers``) in
    place of the MLP's, whole on every tp rank.
    """
    d, f, h = config.d_model, config.ffn_hidden, config.n_heads
    if config.family == "llama":
        # Per RMSNorm: input, normalised, 1 statistic (3 d + 1 with the output).
        norms, outputs, whole = 2 * (2 * d + 1), 2 * d, config.head_dim
        split = 3 * d + 2 * config.kv_dim + h + 4 * f  # q, y, its copy for wo; k, v; lse; MLP
    else:
        # Per LayerNorm: input, 2 statistics (2 d + 2 with the output).
        norms, outputs, whole = 2 * (d + 2), 2 * d, 0
        split = 4 * d + h + 2 * f  # q, k, v, y; lse; fc's output and its GELU
    per_sequence = 0
    if moe:  # and the auxiliary loss's product of E load fractions and mean scores
        split -= 4 * f
        whole += moe_activation_numbers(config)
        per_sequence = config.n_experts
    per_token = whole + outputs + norms / (tp if sequence_parallel else 1) + split / tp
    return (per_token * seq_len + per_sequence) * _FP32


def _block_deferred_bytes(
    config: ModelConfig, seq_len: int, tp: int = 1, moe: bool = False
) -> float:
    """Bytes a block's split backward holds from I to W, per sequence, on one of ``tp``
    ranks: the output gradient of each linear, which its deferred weight product needs
    (its input is among the activations already). Column-wise linears' outputs are split
    over ``tp`` (q, k, v; the MLP's gate and up, or GPT-2's fc); the row-wise ones' (wo,
    the down projection) are whole. A MoE block has the router's scores, E, and per
    assignment, routed or shared, its expert's gate, up and down outputs, whole on every
    tp rank."""
    d, f, kv = config.d_model, config.ffn_hidden, config.kv_dim
    attention = (d + 2 * kv) / tp + d
    if moe:
        assignments = config.top_k + config.n_shared_experts
        mlp: float = config.n_experts + assignments * (2 * config.expert_hidden + d)
    elif config.family == "llama":
        mlp = 2 * f / tp + d
    else:
        mlp = f / tp + d
    return (attention + mlp) * seq_len * _FP32


def _block_linear_input_bytes(
    config: ModelConfig, seq_len: int, tp: int = 1, moe: bool = False
) -> float:
    """Bytes of the inputs of a block's linears, per sequence, on one of ``tp`` ranks: what
    a split backward keeps of its activations from the end of I to W, whose weight products
    need them (the rest of the saved tensors go with I's graph). q, k and v share the
    attention norm's output and the MLP's gate and up (GPT-2's fc) the second norm's, whole
    under tp; wo takes attention's output and the down projection the MLP's hidden
    product, both split. A MoE block's router and shared experts take the norm's output,
    the routed experts a gathered copy, d per assignment, and every expert's down
    projection its hidden product (``expert_hidden`` per assignment, routed or shared)."""
    d, f = config.d_model, config.ffn_hidden
    attention = d + d / tp
    if moe:
        assignments = config.top_k + config.n_shared_experts
        mlp: float = d + config.top_k * d + assignments * config.expert_hidden
    else:
        mlp = d + f / tp
    return (attention + mlp) * seq_len * _FP32


def _head_activation_bytes(
    config: ModelConfig, seq_len: int, tp: int = 1, sequence_parallel: bool = False
) -> float:
    """The head keeps its norm's input and output; the loss its log-softmax (V, split over
    the vocabulary under tensor parallelism) and targets (int64: 2 fp32 slots)."""
    d = config.d_model
    norm = 2 * d + 1 if config.family == "llama" else d + 2  # all but the output, as above
    norm_here = norm / (tp if sequence_parallel else 1)
    return (norm_here + d + config.vocab_size / tp + 2) * seq_len * _FP32


@dataclass(frozen=True)
class _Pricing:
    """Turns a layer's FLOPs and sizes into its ``LayerCost`` on one tp rank."""

    flops_per_second: float
    tp: int
    tp_bandwidth: float | None
    sequence_parallel: bool
    activation: float  # bytes of one (1, T, C) activation

    def __call__(
        self,
        name: str,
        kind: str,
        flops: tuple[float, float, float],
        params: int,
        act: float,
        comm: TpCollectives | None = None,
        alltoall: tuple[float, float] = (0.0, 0.0),
        deferred: float = 0.0,
        freed: float = 0.0,
    ) -> LayerCost:
        (fwd, b_in, b_w), s = flops, self.flops_per_second
        # The collectives wait for their matmul and the next one for them: on the path.
        comm = comm or layer_collectives(kind, sequence_parallel=self.sequence_parallel)
        c_fwd = tp_time(comm.forward, self.activation, self.tp, self.tp_bandwidth) + alltoall[0]
        c_in = tp_time(comm.backward, self.activation, self.tp, self.tp_bandwidth) + alltoall[1]
        return LayerCost(
            name,
            kind,
            fwd / s + c_fwd,
            (b_in + b_w) / s + c_in,
            b_in / s + c_in,
            b_w / s,
            params,
            params * _FP32,
            act,
            deferred_bytes_per_sample=deferred,
            freed_at_input_bytes_per_sample=freed,
        )


def estimate_costs(
    config: ModelConfig,
    seq_len: int,
    *,
    flops_per_second: float = DEFAULT_FLOPS,
    tp: int = 1,
    sequence_parallel: bool = False,
    tp_bandwidth: float | None = None,
    ep: int = 1,
    ep_bandwidth: float | None = None,
) -> list[LayerCost]:
    """One ``LayerCost`` per pipeline layer (embed, blocks, head), per sequence of ``seq_len``,
    for one of ``tp`` tensor-parallel ranks and one of ``ep`` expert-parallel ranks;
    ``tp_bandwidth``, ``ep_bandwidth``: bytes/s of a rank's tp and ep links (None: the
    collectives take no time)."""
    check_tensor_parallel(config, tp, seq_len=seq_len, sequence_parallel=sequence_parallel)
    check_expert_parallel(config, ep)
    d, v = config.d_model, config.vocab_size
    embed_p, _, head_p = layer_params(config, tp)
    t = seq_len
    # One (1, T, C) activation is what a tp all-reduce sums.
    cost = _Pricing(flops_per_second, tp, tp_bandwidth, sequence_parallel, float(t * d * _FP32))

    # The lookup and its scatter-add backward move T x C numbers: memory-bound, a few FLOPs each.
    # It keeps the token ids (int64), and GPT-2 its position ids too.
    ids = t * 8 * (1 if config.family == "llama" else 2)
    # The lookup is no linear: its weight gradient comes with I, and the ids go with it.
    lookup = (2.0 * t * d, 0.0, 2.0 * t * d)
    layers = [cost("embed", "embedding", lookup, embed_p, float(ids), freed=float(ids))]
    sent = alltoall_bytes(t, config.top_k, d, ep, number_bytes=_FP32) if ep > 1 else 0.0
    alltoall = (
        ep_time(ALLTOALLS_FORWARD, sent, ep_bandwidth),
        ep_time(ALLTOALLS_BACKWARD, sent, ep_bandwidth),
    )
    for i in range(config.n_layers):
        moe = config.is_moe_block(i)
        matmul, attention = _block_flops(config, t, tp, moe)
        act = _block_activation_bytes(config, t, tp, sequence_parallel, moe)
        # Input gradient: the matmuls again plus twice the attention core; weight gradient: the matmuls.
        flops = (matmul + attention, matmul + 2 * attention, matmul)
        params = block_params(config, i, tp, ep)
        held = _block_deferred_bytes(config, t, tp, moe)
        freed = max(0.0, act - _block_linear_input_bytes(config, t, tp, moe))
        # MoE: attention's tp collectives only; the experts' all-to-alls.
        comm, exchange = (MOE_TP, alltoall) if moe else (None, (0.0, 0.0))
        layers.append(cost(f"layers.{i}", "block", flops, params, act, comm, exchange, held, freed))
    head = 2.0 * t * d * v / tp
    head_act = _head_activation_bytes(config, t, tp, sequence_parallel)
    # The head's split backward holds its logits' gradient, V / tp per token.
    head_held = float(t * v / tp * _FP32)
    # Its I keeps the norm's output, the linear's input, for W.
    head_freed = head_act - t * d * _FP32
    layers.append(
        cost("head", "head", (head,) * 3, head_p, head_act, deferred=head_held, freed=head_freed)
    )
    if config.tie_embeddings:  # the head's output weight is the token embedding (v x d)
        tied = v * d // tp
        layers[-1] = replace(layers[-1], tied_to=0, tied_params=tied, tied_param_bytes=tied * _FP32)
    return layers
