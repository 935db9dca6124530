"""Seeded initialisation: the same (seed, global layer index) gives the same weights anywhere.

Weights are drawn on the CPU from a ``torch.Generator`` and copied to the device afterwards,
so they do not depend on the device, on the split, or on what other layers were built.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["layer_generator", "layer_seed", "normal_", "ones_", "residual_std", "zeros_"]

_MASK64 = (1 << 64) - 1
BASE_STD = 0.02  # GPT-2's initialiser, also used by Llama reference code


def layer_seed(seed: int, index: int) -> int:
    """A 63-bit seed for one layer, mixed (splitmix64) so nearby seeds share no streams."""
    x = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def layer_generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(layer_seed(seed, index))


def residual_std(n_layers: int) -> float:
    """Smaller initial weights for projections that write into the residual stream (GPT-2)."""
    return BASE_STD / math.sqrt(2 * n_layers)


@torch.no_grad()
def normal_(param: nn.Parameter | torch.Tensor, std: float, generator: torch.Generator) -> None:
    param.normal_(0.0, std, generator=generator)


@torch.no_grad()
def ones_(param: nn.Parameter | torch.Tensor) -> None:
    param.fill_(1.0)


@torch.no_grad()
def zeros_(param: nn.Parameter | torch.Tensor) -> None:
    param.zero_()
