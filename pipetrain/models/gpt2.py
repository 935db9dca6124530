"""GPT-2-style decoder as pipeline layers: learned positions, LayerNorm, GELU MLP, biases.

The output projection is tied to the token embedding by default (``tie_embeddings``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.models.config import ModelConfig, ModelConfigError
from pipetrain.models.embedding import Embedding
from pipetrain.models.init import BASE_STD, normal_, ones_, residual_std, zeros_

__all__ = ["GPT2Block", "GPT2Embedding", "GPT2Head"]


def _init_layer_norm(norm: nn.LayerNorm) -> None:
    ones_(norm.weight)
    zeros_(norm.bias)


class GPT2Embedding(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.max_seq_len = config.max_seq_len
        self.tok = Embedding(config.vocab_size, config.d_model)
        self.pos = Embedding(config.max_seq_len, config.d_model)

    def init_weights(self, generator: torch.Generator) -> None:
        normal_(self.tok.weight, BASE_STD, generator)
        normal_(self.pos.weight, BASE_STD / 2, generator)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.max_seq_len:
            raise ModelConfigError(
                f"sequence length {t} exceeds the model's max_seq_len {self.max_seq_len}: "
                "shorten the sequences or raise max_seq_len"
            )
        positions = torch.arange(t, device=ids.device)
        out: torch.Tensor = self.tok(ids) + self.pos(positions)  # (B, T, C)
        return out


class GPT2Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.d_model, config.d_model)
        self.wk = nn.Linear(config.d_model, config.d_model)
        self.wv = nn.Linear(config.d_model, config.d_model)
        self.wo = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Heads counted from the projections' widths: under tensor parallelism each rank
        # holds n_heads / tp of them.
        q, k, v = (
            w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        out: torch.Tensor = self.wo(y.transpose(1, 2).reshape(b, t, -1))
        return out


class GPT2MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.ffn_hidden)
        self.proj = nn.Linear(config.ffn_hidden, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(F.gelu(self.fc(x), approximate="tanh"))
        return out


class GPT2Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_layers = config.n_layers
        self.ln1 = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.attn = GPT2Attention(config)
        self.ln2 = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.mlp = GPT2MLP(config)

    def init_weights(self, generator: torch.Generator) -> None:
        _init_layer_norm(self.ln1)
        for linear in (self.attn.wq, self.attn.wk, self.attn.wv):
            normal_(linear.weight, BASE_STD, generator)
            zeros_(linear.bias)
        normal_(self.attn.wo.weight, residual_std(self.n_layers), generator)
        zeros_(self.attn.wo.bias)
        _init_layer_norm(self.ln2)
        normal_(self.mlp.fc.weight, BASE_STD, generator)
        zeros_(self.mlp.fc.bias)
        normal_(self.mlp.proj.weight, residual_std(self.n_layers), generator)
        zeros_(self.mlp.proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))  # (B, T, C)
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT2Head(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.out = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def init_weights(self, generator: torch.Generator) -> None:
        _init_layer_norm(self.norm)
        normal_(self.out.weight, BASE_STD, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(self.norm(x))  # (B, T, C) -> (B, T, V)
        return out
