"""Text from the trained model: the stages' weights assembled into one model, then sampled.

Parameters have global names on every stage, so the state dicts of the stages merge into
the state dict of the whole model without renaming.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from pipetrain.config.schema import TrainConfig
from pipetrain.data import Tokenizer
from pipetrain.models import build_full_model, model_spec
from pipetrain.models.config import ModelConfig

__all__ = ["gather_state_dict", "generate", "sample_text"]


def _local_state(modules: Iterable[nn.Module]) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for module in modules:
        for name, tensor in module.state_dict().items():
            if isinstance(tensor, DTensor):
                # Sharded over the dp group (--shard): every replica takes part in the gather.
                tensor = tensor.full_tensor()
            # Replicas (Chimera) repeat names with equal values: keep the first.
            state.setdefault(name, tensor.detach().to("cpu"))
    return state


def gather_state_dict(
    modules: Sequence[nn.Module], group: Any, *, experts_group: Any = None
) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict on rank 0 of ``group`` (None elsewhere).

    ``group`` None: every stage is in this process. Meant for models small enough for one
    process (the sample at the end of a run); large ones go through checkpoints. With
    stages sharded over data-parallel replicas (FSDP2) every replica must call it, since
    the full tensors are gathered over the dp group first. ``experts_group``: expert
    parallelism, the ep group whose ranks hold the other experts (each of them calls it;
    its first rank goes on with the others' experts).
    """
    state: dict[str, torch.Tensor] | None = _local_state(modules)
    # First the experts of the ep group, then the stages of the pipeline: each merged on
    # the group's first rank (a rank that is not first has nothing more to do).
    for over in (experts_group, group):
        if over is None or state is None:
            continue
        gathered: list[dict[str, torch.Tensor] | None] | None = (
            [None] * dist.get_world_size(over) if dist.get_rank(over) == 0 else None
        )
        dist.gather_object(state, gathered, dst=dist.get_global_rank(over, 0), group=over)
        state = None if gathered is None else _merged(gathered)
    return state


def _merged(parts: Sequence[dict[str, torch.Tensor] | None]) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, tensor in (part or {}).items():
            merged.setdefault(name, tensor)
    return merged


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: Sequence[int],
    *,
    new_tokens: int,
    context: int,
    temperature: float,
    seed: int,
) -> list[int]:
    """``new_tokens`` tokens after ``prompt``: greedy at temperature 0, else sampled."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt)], dtype=torch.int64, device=device)  # (1, T)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    out: list[int] = []
    for _ in range(new_tokens):
        logits = model(ids[:, -context:])[0, -1].float().cpu()  # (V,)
        if temperature <= 0:
            token = int(logits.argmax())
        else:
            # Shifted first: a tiny temperature (1e-45) made every logit +-inf, and
            # inf - inf a NaN that multinomial rejects; shifted, it is near-greedy.
            probs = torch.softmax((logits - logits.max()) / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
    return out


def sample_text(
    config: TrainConfig, model: ModelConfig, state: dict[str, torch.Tensor], tokenizer: Tokenizer
) -> str:
    """The run's closing sample: text after ``run.sample_prompt`` from the whole model,
    built on the CPU with the weights ``state`` (by global name, as gathered)."""
    r = config.run
    full = build_full_model(model_spec(model), seed=r.seed, device="cpu")
    full.load_state_dict(state)
    full.eval()
    ids = generate(
        full,
        tokenizer.encode(r.sample_prompt),
        new_tokens=r.sample_tokens,
        context=min(model.max_seq_len, config.data.seq_len),
        temperature=r.sample_temperature,
        seed=r.seed,
    )
    return (
        f"sample (temperature {r.sample_temperature}):\n{r.sample_prompt}{tokenizer.decode(ids)}\n"
    )
