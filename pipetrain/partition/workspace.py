"""What a backward holds while it runs, beside the saved tensors it frees (torch-free).

A stage's backward starts from its last layer with every saved tensor of the micro-batch
still live: the gradients that layer's backward makes before any saved tensor is freed
come on top of the activations the schedule counts. The per-token figures below are the
tensors a profiler trace of the runtime shows live at a process's peak, inside the
running backward (docs/memory_model.md, "The backward in flight"):

- a block: the incoming gradient (d) and the MLP's hidden-width gradients, of the down
  projection's input and of each branch (SwiGLU: 3 f; GELU: 2 f, split over tp); a split
  backward's I also queues the output gradients of the row-wise linears (wo and down,
  2 d, whole under tp) before it frees what its layers keep;
- the head: the logits' gradient and log-softmax's (2 V, split over the vocabulary).

fp32, per sequence, on one of ``tp`` ranks; a MoE block's feed-forward counts the widths
of the experts a token goes to.
"""

from __future__ import annotations

from pipetrain.models.config import ModelConfig

__all__ = ["backward_workspace_bytes"]

_FP32 = 4


def backward_workspace_bytes(
    config: ModelConfig, seq_len: int, tp: int = 1, split: bool = False
) -> dict[str, float]:
    """Per layer kind ("embedding", "block", "head"), the bytes one sequence's backward
    holds beside the saved tensors at its high-water mark; ``split``: run as I then W."""
    d = config.d_model
    if config.n_experts:
        hidden = float((config.top_k + config.n_shared_experts) * config.expert_hidden)
    else:
        hidden = float(config.ffn_hidden)
    branches = 3 if config.family == "llama" else 2
    block = d + branches * hidden / tp + (2 * d if split else 0)
    head = 2 * config.vocab_size / tp
    return {
        "embedding": 0.0,
        "block": block * seq_len * _FP32,
        "head": head * seq_len * _FP32,
    }
