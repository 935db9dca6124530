"""A lookup table whose construction draws no random numbers.

``nn.Embedding`` initialises itself with ``normal_`` on construction; on the meta device that
call goes through torch's reference implementations and imports ``torch._dynamo``, seconds
of start-up for every rank. Our layers initialise in ``init_weights`` anyway, so this one
only allocates. It is an ``nn.Embedding`` otherwise (same parameter name, ``weight``, and
the same forward), so that what handles embeddings handles it too: tensor parallelism
shards it over the vocabulary (``RowwiseParallel`` takes only ``nn.Linear`` and
``nn.Embedding``).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Embedding"]


class Embedding(nn.Embedding):
    def __init__(self, num_embeddings: int, dim: int) -> None:
        nn.Module.__init__(self)  # not nn.Embedding's: it would draw the weights
        self.num_embeddings = num_embeddings
        self.embedding_dim = dim
        self.padding_idx = None
        self.max_norm = None
        self.norm_type = 2.0
        self.scale_grad_by_freq = False
        self.sparse = False
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim))
