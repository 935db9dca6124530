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
"""

from __future__ import annotations

from dataclasses import replace

from pipetrain.models.config import ModelConfig
from pipetrain.partition.balance import LayerCost, PartitionError
from pipetrain.sim.tensor_parallel import layer_collectives, tp_time

__all__ = ["DEFAULT_FLOPS", "check_tensor_parallel", "estimate_costs", "layer_params"]

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


def _block_flops(config: ModelConfig, seq_len: int) -> tuple[float, float]:
    """Forward FLOPs of one block for one sequence: (matmuls with weights, attention core)."""
    d, f, kv = config.d_model, config.ffn_hidden, config.kv_dim
    proj = d * d + 2 * d * kv + d * d
    mlp = 3 * d * f if config.family == "llama" else 2 * d * f
    matmul = 2.0 * seq_len * (proj + mlp)
    attention = 4.0 * seq_len * seq_len * d  # Q K^T and A V, computed in full by the CPU kernels
    return matmul, attention


def _block_activation_bytes(
    config: ModelConfig, seq_len: int, tp: int = 1, sequence_parallel: bool = False
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
    input).
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
    per_token = whole + outputs + norms / (tp if sequence_parallel else 1) + split / tp
    return per_token * seq_len * _FP32


def _head_activation_bytes(
    config: ModelConfig, seq_len: int, tp: int = 1, sequence_parallel: bool = False
) -> float:
    """The head keeps its norm's input and output; the loss its log-softmax (V, split over
    the vocabulary under tensor parallelism) and targets (int64: 2 fp32 slots)."""
    d = config.d_model
    norm = 2 * d + 1 if config.family == "llama" else d + 2  # all but the output, as above
    norm_here = norm / (tp if sequence_parallel else 1)
    return (norm_here + d + config.vocab_size / tp + 2) * seq_len * _FP32


def estimate_costs(
    config: ModelConfig,
    seq_len: int,
    *,
    flops_per_second: float = DEFAULT_FLOPS,
    tp: int = 1,
    sequence_parallel: bool = False,
    tp_bandwidth: float | None = None,
) -> list[LayerCost]:
    """One ``LayerCost`` per pipeline layer (embed, blocks, head), per sequence of ``seq_len``,
    for one of ``tp`` tensor-parallel ranks; ``tp_bandwidth``: bytes/s of a rank's tp link
    (None: the tp collectives take no time)."""
    check_tensor_parallel(config, tp, seq_len=seq_len, sequence_parallel=sequence_parallel)
    d, v = config.d_model, config.vocab_size
    embed_p, block_p, head_p = layer_params(config, tp)
    t = seq_len
    activation = float(t * d * _FP32)  # one (1, T, C) activation, what a tp all-reduce sums

    def cost(
        name: str, kind: str, fwd: float, b_in: float, b_w: float, params: int, act: float
    ) -> LayerCost:
        s = flops_per_second
        # The collectives wait for their matmul and the next one for them: on the path.
        comm = layer_collectives(kind, sequence_parallel=sequence_parallel)
        c_fwd = tp_time(comm.forward, activation, tp, tp_bandwidth)
        c_in = tp_time(comm.backward, activation, tp, tp_bandwidth)
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
        )

    # The lookup and its scatter-add backward move T x C numbers: memory-bound, a few FLOPs each.
    # It keeps the token ids (int64), and GPT-2 its position ids too.
    ids = t * 8 * (1 if config.family == "llama" else 2)
    layers = [cost("embed", "embedding", 2.0 * t * d, 0.0, 2.0 * t * d, embed_p, float(ids))]
    matmul, attention = _block_flops(config, t)
    matmul, attention = matmul / tp, attention / tp  # each rank its heads and hidden units
    act = _block_activation_bytes(config, t, tp, sequence_parallel)
    for i in range(config.n_layers):
        # Input gradient: the matmuls again plus twice the attention core; weight gradient: the matmuls.
        layers.append(
            cost(
                f"layers.{i}",
                "block",
                matmul + attention,
                matmul + 2 * attention,
                matmul,
                block_p,
                act,
            )
        )
    head = 2.0 * t * d * v / tp
    head_act = _head_activation_bytes(config, t, tp, sequence_parallel)
    layers.append(cost("head", "head", head, head, head, head_p, head_act))
    if config.tie_embeddings:  # the head's output weight is the token embedding (v x d)
        tied = v * d // tp
        layers[-1] = replace(layers[-1], tied_to=0, tied_params=tied, tied_param_bytes=tied * _FP32)
    return layers
