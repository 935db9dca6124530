"""Tensor parallelism inside a stage: torch's DTensor plans applied to each layer.

Every block is sharded the Megatron way over the "tp" dimension of the mesh: attention's
q, k and v projections and the MLP's gate and up projections column-wise (each rank holds
n_heads / tp query heads, n_kv_heads / tp key/value heads and ffn / tp hidden units),
attention's output and the MLP's down projection row-wise, so a sub-layer costs one
all-reduce forward and one backward. The embedding is sharded over the vocabulary (each
rank looks up the rows it holds, an all-reduce adds them) and the head's projection too:
its logits stay sharded over the vocabulary (a DTensor) and the runtime computes the
loss on them under ``loss_parallel``, so the full (B, T, V) logits never exist on a rank.

``sequence_parallel``: the norms (and the residual stream between sub-layers) run on
1/tp of the sequence; the all-reduce after a row-wise projection becomes a
reduce-scatter and the one before a column-wise projection an all-gather. Activations
that cross a stage boundary are then the rank's (B, T/tp, C) slice, which its peer of the
same tp index on the next stage expects.

Weights tied across layers (GPT-2's embedding and head) are both sharded over the
vocabulary (dimension 0), so the pipeline sums their local shards as it summed the whole.

The layers' classes name their plans (``_PLANS``); a user's own layer is refused with one
line. Everything here is torch's own ``parallelize_module``; no collective is written by
hand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from pipetrain.errors import InputError
from pipetrain.models.config import ModelConfig
from pipetrain.models.gpt2 import GPT2Block, GPT2Embedding, GPT2Head
from pipetrain.models.llama import LlamaBlock, LlamaEmbedding, LlamaHead
from pipetrain.models.stage import StageModule
from pipetrain.runtime import Pipeline

__all__ = [
    "TensorParallelError",
    "check_divisible",
    "check_model_divisible",
    "shard_pipeline",
    "shard_stage",
]


class TensorParallelError(InputError):
    """A model or a layer that tensor parallelism cannot shard as asked."""


def check_divisible(*, n_heads: int, n_kv_heads: int, ffn_hidden: int, vocab: int, tp: int) -> None:
    """Refuse, in one line, sizes that ``tp`` ranks cannot share evenly."""
    for what, size in (
        ("n_heads", n_heads),
        ("n_kv_heads", n_kv_heads),
        ("ffn_hidden", ffn_hidden),
        ("vocab_size", vocab),
    ):
        if size % tp:
            raise TensorParallelError(
                f"pipeline.tp is {tp} but the model's {what} is {size}, which {tp} ranks "
                f"cannot share evenly: use a --tp that divides {size}, or another model"
            )


def check_model_divisible(model: ModelConfig, tp: int) -> None:
    """``check_divisible`` on a model's own sizes."""
    check_divisible(
        n_heads=model.n_heads,
        n_kv_heads=model.n_kv_heads,
        ffn_hidden=model.ffn_hidden,
        vocab=model.vocab_size,
        tp=tp,
    )


Plan = dict[str, Any]


def _block_plan(
    attn: str, mlp_in: tuple[str, ...], mlp_out: str, norms: tuple[str, str], sp: bool
) -> Plan:
    """A transformer block: column-wise in, row-wise out, for attention and MLP."""
    # With sequence parallelism the block's input and output are (B, T/tp, C) slices.
    seq = Shard(1)
    plan: Plan = {
        f"{attn}.wq": ColwiseParallel(),
        f"{attn}.wk": ColwiseParallel(),
        f"{attn}.wv": ColwiseParallel(),
        f"{attn}.wo": RowwiseParallel(output_layouts=seq) if sp else RowwiseParallel(),
        **{f"mlp.{name}": ColwiseParallel() for name in mlp_in},
        f"mlp.{mlp_out}": RowwiseParallel(output_layouts=seq) if sp else RowwiseParallel(),
    }
    if sp:
        for norm in norms:
            plan[norm] = SequenceParallel()
        # The norms' outputs are sequence slices; attention and the MLP need all of it.
        for module in (attn, "mlp"):
            plan[module] = PrepareModuleInput(
                input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True
            )
    return plan


def _moe_block_plan(sp: bool) -> Plan:
    """A MoE block: attention sharded as in a dense block; the router and the experts stay
    whole on every tp rank (each routes the same tokens; ``--ep`` splits the experts)."""
    if sp:
        raise TensorParallelError(
            "pipeline.sequence_parallel is not supported with mixture-of-experts blocks "
            "(routing needs the whole sequence): drop --sequence-parallel"
        )
    plan = _block_plan("attn", (), "", ("attn_norm", "mlp_norm"), sp)
    return {k: v for k, v in plan.items() if not k.startswith("mlp.")}


def _embedding_plan(names: tuple[str, ...], sp: bool) -> Plan:
    # Token ids are the same on every tp rank; the lookup's partial sums are added
    # (all-reduce), or with sequence parallelism scattered over the sequence.
    out = Shard(1) if sp else Replicate()
    plan: Plan = {"tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=out)}
    # GPT-2's position table stays whole: positions are not split by vocabulary.
    if "pos" in names and sp:
        raise TensorParallelError(
            "pipeline.sequence_parallel is not supported with gpt2's learned positions "
            "(their sum with the token lookup would mix a sliced and a whole sequence): "
            "drop --sequence-parallel for gpt2 models"
        )
    return plan


def _head_plan(sp: bool) -> Plan:
    plan: Plan = {
        # Logits stay sharded over the vocabulary: the loss runs under loss_parallel.
        "out": ColwiseParallel(
            input_layouts=Shard(1) if sp else Replicate(),
            output_layouts=Shard(-1),
            use_local_output=False,
        ),
    }
    if sp:
        plan["norm"] = SequenceParallel()
    return plan


_PLANS: dict[type[nn.Module], Callable[[bool], Plan]] = {
    LlamaBlock: lambda sp: _block_plan("attn", ("w1", "w3"), "w2", ("attn_norm", "mlp_norm"), sp),
    GPT2Block: lambda sp: _block_plan("attn", ("fc",), "proj", ("ln1", "ln2"), sp),
    LlamaEmbedding: lambda sp: _embedding_plan(("tok",), sp),
    GPT2Embedding: lambda sp: _embedding_plan(("tok", "pos"), sp),
    LlamaHead: _head_plan,
    GPT2Head: _head_plan,
}


def shard_pipeline(pipeline: Pipeline, tp_mesh: Any, *, sequence_parallel: bool = False) -> None:
    """Shard every stage of this rank over ``tp_mesh``; before the stage options (recompute,
    precision, compile) and before FSDP2, which then shards the tp shards over dp."""
    for module in pipeline.modules:
        shard_stage(module, tp_mesh, sequence_parallel=sequence_parallel)
    # The sums of tied weights (and Chimera's replicas) must add the sharded parameters.
    pipeline.rebind_parameters()


def shard_stage(module: nn.Module, tp_mesh: Any, *, sequence_parallel: bool = False) -> None:
    """Shard every layer of a stage module (``StageModule``) over ``tp_mesh`` in place.

    Tied weights are tied again after sharding: each layer's plan replaces its own
    parameters, which would leave the two copies of one weight apart.
    """
    for name, layer in _stage_layers(module):
        moe = isinstance(layer, LlamaBlock) and hasattr(layer, "moe")
        plan = _moe_block_plan if moe else _PLANS.get(type(layer))
        if plan is None:
            raise TensorParallelError(
                f"layer {name} ({type(layer).__name__}) has no tensor-parallel plan: "
                f"pipeline.tp works with pipetrain's llama and gpt2 layers; use --tp 1"
            )
        parallelize_module(layer, tp_mesh, plan(sequence_parallel))
    if isinstance(module, StageModule):
        _retie(module)
    for param in module.parameters():
        if isinstance(param, DTensor):
            param.register_post_accumulate_grad_hook(_grad_like_param)  # type: ignore[no-untyped-call]


def _grad_like_param(param: torch.Tensor) -> None:
    """Give a gradient its parameter's layout. The vocabulary-sharded embedding's backward
    returns a replicated (whole) gradient for a sharded weight; kept so, it would cost a
    whole table per rank, and the sum of a tied weight across stages would add a whole
    table on one rank to a shard on the other. Replicate -> Shard is a local slice."""
    grad = param.grad
    assert isinstance(param, DTensor)
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def _retie(module: StageModule) -> None:
    """Make the copy of a tied weight the owner's (sharded) parameter again where both
    layers are on this stage; across stages the pipeline sums the copies' gradients."""
    held = dict(zip(module.layer_indices, module.layer_names, strict=True))
    for tie in module.spec.tied:
        if tie.owner in held and tie.copy_layer in held:
            owner = module.get_parameter(f"{held[tie.owner]}.{tie.owner_param}")
            parent, _, leaf = f"{held[tie.copy_layer]}.{tie.copy_param}".rpartition(".")
            setattr(module.get_submodule(parent), leaf, owner)


def _stage_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The (global name, layer) pairs of a stage, as ``StageModule`` registers them."""
    names = getattr(module, "layer_names", None)
    if names is None:
        return list(module.named_children())
    return [(name, module.get_submodule(name)) for name in names]
