"""A lookup table whose construction draws no random numbers.

``nn.Embedding`` initialises itself with ``normal_`` on construction; on the meta device that
call goes through torch's reference implementations and imports ``torch._dynamo``, seconds
of start-up for every rank. Our layers initialise in ``init_weights`` anyway, so this one
only allocates. Same parameter name (``weight``) and the same ``F.embedding`` forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Embedding"]


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)  # (B, T) -> (B, T, C)
