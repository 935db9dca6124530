"""Text from a checkpoint, run through the model cut into pipeline stages.

With a process group each rank holds one stage: the first embeds the tokens, hidden
states (1, T, C) go from rank to rank, the last samples the next token and every rank
receives it. Without one, the stages of a ``pp``-way split run one after the other in
this process. Either way the weights come from the checkpoint by global name, so any
split of the model gives the same text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.checkpoint.errors import CheckpointIncompatibleError
from pipetrain.checkpoint.load import load_checkpoint
from pipetrain.checkpoint.manifest import Manifest
from pipetrain.errors import InputError
from pipetrain.models import ModelConfig, StageModule, build_stage, model_spec
from pipetrain.runtime.inputs import even_split

__all__ = ["Generation", "PipelineModel", "generate_tokens", "load_pipeline_model"]


@dataclass(frozen=True)
class PipelineModel:
    """The stages this process holds of a model loaded from a checkpoint."""

    config: ModelConfig
    manifest: Manifest
    stages: tuple[StageModule, ...]
    split: tuple[tuple[int, ...], ...]  # every stage's layers, in order
    group: Any  # None: every stage is here


@dataclass(frozen=True)
class Generation:
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]  # the new ones only


def model_config_of(manifest: Manifest, path: Path) -> ModelConfig:
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(manifest.model) - fields)
    if unknown:
        raise CheckpointIncompatibleError(
            f"{path} describes its model with field {unknown[0]!r}, which this pipetrain's "
            "ModelConfig lacks; use the pipetrain that wrote it"
        )
    return ModelConfig(**dict(manifest.model))


def load_pipeline_model(
    path: Path, *, pp: int, device: torch.device, group: Any = None
) -> PipelineModel:
    """Build a ``pp``-stage split (this rank's stage with a group) and load the checkpoint."""
    from pipetrain.checkpoint.manifest import read_manifest

    manifest = read_manifest(path)
    config = model_config_of(manifest, path)
    spec = model_spec(config)
    if not 1 <= pp <= len(spec):
        raise InputError(
            f"--pp {pp} does not fit a model of {len(spec)} layers: use 1 to {len(spec)} stages"
        )
    split = even_split(len(spec), pp)
    held = [dist.get_rank(group)] if group is not None else range(pp)
    stages = tuple(build_stage(spec, split[s], seed=0, device=device) for s in held)
    load_checkpoint(path, modules=stages, restore_rng=False, group=group)
    for stage in stages:
        stage.eval()
    return PipelineModel(config, manifest, stages, split, group)


def _local_forward(model: PipelineModel) -> Callable[[torch.Tensor], torch.Tensor | None]:
    def forward(ids: torch.Tensor) -> torch.Tensor | None:
        x = ids
        for stage in model.stages:
            x = stage(x)
        return x[0, -1]

    return forward


def _dist_forward(
    model: PipelineModel, device: torch.device
) -> Callable[[torch.Tensor], torch.Tensor | None]:
    group = model.group
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    stage = model.stages[0]

    def forward(ids: torch.Tensor) -> torch.Tensor | None:
        if rank == 0:
            x = stage(ids)  # (1, T) -> (1, T, C)
        else:
            # Every rank knows the tokens so far, hence the shape of what comes.
            x = torch.empty(1, ids.shape[1], model.config.d_model, device=device)
            dist.recv(x, group_src=rank - 1, group=group)
            x = stage(x)
        if rank < size - 1:
            dist.send(x.contiguous(), group_dst=rank + 1, group=group)
            return None
        logits: torch.Tensor = x[0, -1]  # (V,) logits of the last position
        return logits

    return forward


@torch.no_grad()
def generate_tokens(
    model: PipelineModel,
    prompt: Sequence[int],
    *,
    new_tokens: int,
    temperature: float,
    seed: int,
    device: torch.device,
    context: int | None = None,
) -> Generation:
    """Greedy at temperature 0, else sampled with a generator seeded by ``seed``; the
    same tokens on every rank."""
    if not prompt:
        raise InputError("the prompt is empty: give some text to start from (--prompt TEXT)")
    if max(prompt) >= model.config.vocab_size:
        raise InputError(
            f"the prompt has token id {max(prompt)} but the model's vocabulary is "
            f"{model.config.vocab_size}: use the tokenizer the model was trained with"
        )
    window = min(context or model.config.max_seq_len, model.config.max_seq_len)
    forward = _local_forward(model) if model.group is None else _dist_forward(model, device)
    last_rank = 0
    if model.group is not None:
        last_rank = dist.get_global_rank(model.group, dist.get_world_size(model.group) - 1)
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    out: list[int] = []
    for _ in range(new_tokens):
        logits = forward(torch.tensor([ids[-window:]], dtype=torch.int64, device=device))
        token = torch.zeros(1, dtype=torch.int64)
        if logits is not None:
            logits = logits.float().cpu()
            if temperature <= 0:
                token[0] = int(logits.argmax())
            else:
                # Shifted first: a tiny temperature (1e-45) made every logit +-inf, and
                # inf - inf a NaN that multinomial rejects; shifted, it is near-greedy.
                probs = torch.softmax((logits - logits.max()) / temperature, dim=-1)
                token[0] = int(torch.multinomial(probs, 1, generator=generator))
        if model.group is not None:
            # gloo broadcasts CPU tensors; on NCCL the token travels on the device.
            moved = token.to(device)
            dist.broadcast(moved, src=last_rank, group=model.group)
            token = moved.cpu()
        ids.append(int(token[0]))
        out.append(int(token[0]))
    return Generation(tuple(prompt), tuple(out))
