"""Layer costs from the model's shape alone: parameter counts, FLOPs and saved activations.

Used by ``pipetrain plan`` when nothing is measured (``--balance uniform|params`` and
explicit splits), and for real sizes that do not fit the machine. Times are FLOPs divided by
an assumed throughput, so they rank stages correctly but are only as good as that number.
Torch-free.
"""

from __future__ import annotations

from dataclasses import replace

from pipetrain.models.config import ModelConfig
from pipetrain.partition.balance import LayerCost

__all__ = ["DEFAULT_FLOPS", "estimate_costs", "layer_params"]

# About what 2 CPU cores sustain on small fp32 matmuls (the 6.6 M-parameter reference model
# trains at ~2500 tokens/s: 6 x 6.6e6 x 2500 = 1e11 FLOP/s).
DEFAULT_FLOPS = 1e11
_FP32 = 4


def layer_params(config: ModelConfig) -> tuple[int, int, int]:
    """Parameters of the embedding, of one block, and of the head (its own copy if tied)."""
    d, v, f, kv = config.d_model, config.vocab_size, config.ffn_hidden, config.kv_dim
    if config.family == "llama":
        embed = v * d
        block = 2 * d + d * d + 2 * d * kv + d * d + 3 * d * f
        head = d + v * d
    else:
        embed = v * d + config.max_seq_len * d
        block = 2 * 2 * d + 4 * (d * d + d) + (d * f + f) + (f * d + d)
        head = 2 * d + v * d
    return embed, block, head


def _block_flops(config: ModelConfig, seq_len: int) -> tuple[float, float]:
    """Forward FLOPs of one block for one sequence: (matmuls with weights, attention core)."""
    d, f, kv = config.d_model, config.ffn_hidden, config.kv_dim
    proj = d * d + 2 * d * kv + d * d
    mlp = 3 * d * f if config.family == "llama" else 2 * d * f
    matmul = 2.0 * seq_len * (proj + mlp)
    attention = 4.0 * seq_len * seq_len * d  # Q K^T and A V, computed in full by the CPU kernels
    return matmul, attention


def _block_activation_bytes(config: ModelConfig, seq_len: int) -> float:
    """Bytes a block keeps for its backward, per sequence, fp32.

    Counted from what autograd saves in these modules (the profiler's figure for the tiny
    presets, exactly): per token, the residual input, the norm outputs and the views the
    linears keep, q, k, v (k and v at their own width: attention pairs the GQA heads without
    repeating them), the attention output; the MLP's
    hidden tensors (SwiGLU keeps gate, up, their activation and product; GELU keeps two);
    the norm statistics, one log-sum-exp per head (memory-efficient attention keeps no
    T x T matrix), and for Llama one head-width tensor per micro-batch in attention,
    charged here to every sample (so a little high for micro-batches of several samples).
    """
    d, f, h = config.d_model, config.ffn_hidden, config.n_heads
    if config.family == "llama":
        per_token = 9 * d + 2 * config.kv_dim + 4 * f + h + 2 + config.head_dim
    else:
        per_token = 8 * d + 2 * f + h + 4
    return float(per_token * seq_len * _FP32)


def _head_activation_bytes(config: ModelConfig, seq_len: int) -> float:
    """The head keeps its norm's input and output; the loss its log-softmax (V) and targets."""
    norm = 3 * config.d_model + 1 if config.family == "llama" else 2 * config.d_model + 2
    return float((norm + config.vocab_size + 2) * seq_len * _FP32)


def estimate_costs(
    config: ModelConfig, seq_len: int, *, flops_per_second: float = DEFAULT_FLOPS
) -> list[LayerCost]:
    """One ``LayerCost`` per pipeline layer (embed, blocks, head), per sequence of ``seq_len``."""
    d, v = config.d_model, config.vocab_size
    embed_p, block_p, head_p = layer_params(config)
    t = seq_len

    def cost(
        name: str, kind: str, fwd: float, b_in: float, b_w: float, params: int, act: float
    ) -> LayerCost:
        s = flops_per_second
        return LayerCost(
            name, kind, fwd / s, (b_in + b_w) / s, b_in / s, b_w / s, params, params * _FP32, act
        )

    # The lookup and its scatter-add backward move T x C numbers: memory-bound, a few FLOPs each.
    # It keeps the token ids (int64), and GPT-2 its position ids too.
    ids = t * 8 * (1 if config.family == "llama" else 2)
    layers = [cost("embed", "embedding", 2.0 * t * d, 0.0, 2.0 * t * d, embed_p, float(ids))]
    matmul, attention = _block_flops(config, t)
    act = _block_activation_bytes(config, t)
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
    head = 2.0 * t * d * v
    layers.append(cost("head", "head", head, head, head, head_p, _head_activation_bytes(config, t)))
    if config.tie_embeddings:  # the head's output weight is the token embedding (v x d)
        layers[-1] = replace(
            layers[-1], tied_to=0, tied_params=v * d, tied_param_bytes=v * d * _FP32
        )
    return layers
