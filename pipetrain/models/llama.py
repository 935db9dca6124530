"""Llama-style decoder as three kinds of pipeline layer: embedding, block, head.

RMSNorm, rotary position embedding, grouped-query attention, SwiGLU MLP. Every layer has
``init_weights(generator)`` so that a stage built on the meta device can be materialised
and initialised layer by layer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.models.config import ModelConfig
from pipetrain.models.embedding import Embedding
from pipetrain.models.init import BASE_STD, normal_, ones_, residual_std, zeros_

__all__ = ["LlamaBlock", "LlamaEmbedding", "LlamaHead", "RMSNorm", "apply_rotary", "rotary_tables"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 even for low-precision inputs: the mean of squares overflows in fp16.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rotary_tables(
    seq_len: int,
    head_dim: int,
    theta: float,
    device: torch.device,
    scaling: tuple[float, float, float, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each (T, head_dim/2), in float32.

    ``scaling``: Llama 3's (factor, low_freq_factor, high_freq_factor, original length)
    (``ModelConfig.rope_scaling``); None leaves the frequencies as they are.

    Not a module buffer: a buffer would be garbage after a meta build. Every block of every
    micro-batch asks for the same tables, so they are computed once per (length, width,
    theta, device) and shared: recomputing them cost about 1% of a step on CPU.
    """
    key = (seq_len, head_dim, theta, scaling, str(device))
    tables = _ROTARY_CACHE.get(key)
    if tables is None:
        # Normal tensors even when first asked for under inference_mode: a cached inference
        # tensor could not be saved for a later training backward.
        with torch.inference_mode(False):
            positions = torch.arange(seq_len, device=device, dtype=torch.float32)
            exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
            inv_freq = 1.0 / theta**exponents
            if scaling is not None:
                inv_freq = _llama3_frequencies(inv_freq, *scaling)
            angles = torch.outer(positions, inv_freq)
            tables = (angles.cos(), angles.sin())
        if len(_ROTARY_CACHE) >= _ROTARY_CACHE_SIZE:
            _ROTARY_CACHE.pop(next(iter(_ROTARY_CACHE)))  # the oldest: lengths seen long ago
        _ROTARY_CACHE[key] = tables
    return tables


# A few sequence lengths at most in a run (training, evaluation, generation's growing prefix).
_ROTARY_CACHE_SIZE = 64
_ROTARY_CACHE: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] = {}


def _llama3_frequencies(
    inv_freq: torch.Tensor, factor: float, low: float, high: float, original: int
) -> torch.Tensor:
    """Llama 3.1's frequency scaling (as Hugging Face's rope_type "llama3"): wavelengths
    longer than original/low divided by ``factor``, shorter than original/high kept, and
    the band between blended linearly in original/wavelength."""
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, blended, scaled)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., 2i], x[..., 2i+1]) of x: (B, H, T, D) by the angles of each position."""
    xf = x.float().reshape(*x.shape[:-1], -1, 2)  # (B, H, T, D/2, 2)
    even, odd = xf[..., 0], xf[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class LlamaEmbedding(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.tok = Embedding(config.vocab_size, config.d_model)

    def init_weights(self, generator: torch.Generator) -> None:
        normal_(self.tok.weight, BASE_STD, generator)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.tok(ids)  # (B, T) -> (B, T, C)
        return out


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        self.rope_scaling = config.rope_scaling
        bias = config.qkv_bias  # Qwen2's q, k, v biases; the output projection has none
        self.wq = nn.Linear(config.d_model, config.d_model, bias=bias)
        self.wk = nn.Linear(config.d_model, config.kv_dim, bias=bias)
        self.wv = nn.Linear(config.d_model, config.kv_dim, bias=bias)
        self.wo = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Heads counted from the projections' widths, not the config: under tensor
        # parallelism each rank holds n_heads / tp of them (and n_kv_heads / tp).
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        cos, sin = rotary_tables(t, self.head_dim, self.rope_theta, x.device, self.rope_scaling)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # Each key/value head serves n_heads / n_kv_heads query heads; SDPA pairs them itself
        # instead of materialising repeated keys and values (same numbers, 10-30% less time
        # for attention on CPU).
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads
        )  # (B, H, T, D)
        out: torch.Tensor = self.wo(y.transpose(1, 2).reshape(b, t, -1))
        return out


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.d_model, config.ffn_hidden, bias=False)  # gate
        self.w3 = nn.Linear(config.d_model, config.ffn_hidden, bias=False)  # up
        self.w2 = nn.Linear(config.ffn_hidden, config.d_model, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class LlamaBlock(nn.Module):
    """Attention and a feed-forward: the dense SwiGLU ``mlp``, or a mixture of experts
    ``moe`` when one is given (``pipetrain.models.moe``)."""

    def __init__(self, config: ModelConfig, moe: nn.Module | None = None) -> None:
        super().__init__()
        self.n_layers = config.n_layers
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = LlamaAttention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        if moe is None:
            self.mlp = SwiGLU(config)
        else:
            self.moe = moe

    def init_weights(self, generator: torch.Generator) -> None:
        ones_(self.attn_norm.weight)
        for linear in (self.attn.wq, self.attn.wk, self.attn.wv):
            normal_(linear.weight, BASE_STD, generator)
            if linear.bias is not None:
                zeros_(linear.bias)
        normal_(self.attn.wo.weight, residual_std(self.n_layers), generator)
        ones_(self.mlp_norm.weight)
        if hasattr(self, "moe"):
            self.moe.init_weights(generator)  # type: ignore[operator]
            return
        normal_(self.mlp.w1.weight, BASE_STD, generator)
        normal_(self.mlp.w3.weight, BASE_STD, generator)
        normal_(self.mlp.w2.weight, residual_std(self.n_layers), generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))  # (B, T, C)
        ffn = self.moe if hasattr(self, "moe") else self.mlp
        out: torch.Tensor = x + ffn(self.mlp_norm(x))
        return out


class LlamaHead(nn.Module):
    """Final norm and the output projection; ``out.weight`` is the tied copy when tied."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.out = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def init_weights(self, generator: torch.Generator) -> None:
        ones_(self.norm.weight)
        normal_(self.out.weight, BASE_STD, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(self.norm(x))  # (B, T, C) -> (B, T, V)
        return out
