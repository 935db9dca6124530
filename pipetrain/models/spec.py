"""A model as an ordered list of pipeline layers (the DeepSpeed LayerSpec idea).

Layer index = position in the list. For the built-in models: the embedding is layer 0,
block i is layer i + 1, and the head is last. Each layer has a global module prefix that
every stage keeps, so parameter names never depend on the split. A layer named "" keeps
its submodules' own names at the top (``norm.weight``, ``output.weight``).

A layer gets the previous layer's output as positional arguments and, as keyword
arguments, the side inputs it declares (``LayerSpec.inputs``): the spec's ``constants``
(a factory per name, called with the device once per stage: a RoPE table) and its
``extras`` (tensors passed with each batch, ``pipe.step(..., extras={...})``, cut into
micro-batches like the inputs: position ids, attention masks). Side inputs never cross a
stage boundary; every stage whose layers ask for one gets it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pipetrain.errors import InputError
from pipetrain.models.config import ModelConfig
from pipetrain.models.gpt2 import GPT2Block, GPT2Embedding, GPT2Head
from pipetrain.models.llama import LlamaBlock, LlamaEmbedding, LlamaHead
from pipetrain.models.moe import MoEFeedForward

__all__ = [
    "LAYER_KINDS",
    "ConstantFactory",
    "LayerSpec",
    "PipelineSpec",
    "SpecError",
    "TiedWeight",
    "model_spec",
]

LAYER_KINDS = ("embedding", "block", "head")

# device -> a tensor every layer of a stage that asks for it shares (a RoPE table).
ConstantFactory = Callable[[torch.device], torch.Tensor]


class SpecError(InputError):
    """A layer list that cannot be pipelined (bad names, kinds, or tied weights)."""


@dataclass(frozen=True)
class LayerSpec:
    """One pipeline layer: its global prefix, its kind, a zero-argument factory, and the
    names of the side inputs (the spec's constants and extras) its forward takes as
    keyword arguments. The prefix "" puts the layer's submodules at the top level.

    The factory is called on the meta device when the module defines
    ``init_weights(generator)``; otherwise on the CPU under a seeded RNG (see ``build_stage``).
    """

    name: str
    kind: str
    build: Callable[[], nn.Module]
    inputs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in LAYER_KINDS:
            raise SpecError(
                f"layer {self.name!r} has kind {self.kind!r}: use one of {', '.join(LAYER_KINDS)}"
            )
        if self.name and any(not part for part in self.name.split(".")):
            raise SpecError(
                f"layer name {self.name!r} is not a dotted module path like 'layers.3' "
                f"(or '' for names at the top level)"
            )
        if isinstance(self.inputs, str) or not all(
            isinstance(n, str) and n.isidentifier() for n in self.inputs
        ):
            raise SpecError(
                f"layer {self.name!r} has inputs={self.inputs!r}: pass a tuple of keyword "
                f"argument names, e.g. inputs=('rope',)"
            )


@dataclass(frozen=True)
class TiedWeight:
    """One parameter shared by two layers, e.g. the token embedding and the LM head.

    ``owner`` holds the canonical parameter ``key`` (``"embed.tok.weight"``); the layer
    ``copy_layer`` uses it as its parameter ``copy_param`` (``"out.weight"``, local to the
    layer). On a stage that holds both layers they are one tensor; on different stages
    each holds a copy, initialised equal, whose gradients the runtime sums.
    """

    key: str
    owner: int
    owner_param: str
    copy_layer: int
    copy_param: str


@dataclass(frozen=True)
class PipelineSpec:
    """The ordered layers of a model, its tied weights and its side inputs: ``constants``
    (name, factory called with the device) and ``extras`` (names of per-batch tensors)."""

    layers: tuple[LayerSpec, ...]
    tied: tuple[TiedWeight, ...] = ()
    constants: tuple[tuple[str, ConstantFactory], ...] = ()
    extras: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.layers:
            raise SpecError("a pipeline needs at least one layer")
        self._check_side_inputs()
        names = [layer.name for layer in self.layers if layer.name]
        for i, name in enumerate(names):
            for other in names[:i]:
                if name == other or name.startswith(other + ".") or other.startswith(name + "."):
                    raise SpecError(
                        f"layer names {other!r} and {name!r} clash: give every layer its own prefix"
                    )
        for tie in self.tied:
            for index in (tie.owner, tie.copy_layer):
                if not 0 <= index < len(self.layers):
                    raise SpecError(
                        f"tied weight {tie.key!r} names layer {index}, outside 0..{len(self.layers) - 1}"
                    )
            if tie.owner == tie.copy_layer:
                raise SpecError(f"tied weight {tie.key!r} ties layer {tie.owner} to itself")

    def _check_side_inputs(self) -> None:
        declared = [name for name, _ in self.constants] + list(self.extras)
        for name in declared:
            if not (isinstance(name, str) and name.isidentifier()) or declared.count(name) > 1:
                raise SpecError(
                    f"side input {name!r} is declared twice or is not a keyword argument name: "
                    f"give each constant and extra its own identifier"
                )
        for name, factory in self.constants:
            if not callable(factory):
                raise SpecError(
                    f"constant {name!r} is not a factory: pass a function of the device "
                    f"(lambda device: torch.arange(8, device=device))"
                )
        for i, layer in enumerate(self.layers):
            for name in layer.inputs:
                if name not in declared:
                    raise SpecError(
                        f"layer {i} ({layer.name!r}) takes side input {name!r}, which the spec "
                        f"does not declare: add it to constants= (built once per stage) or "
                        f"extras= (passed with each batch)"
                    )

    @property
    def constant_factories(self) -> dict[str, ConstantFactory]:
        return dict(self.constants)

    def side_inputs(self, layer_indices: Sequence[int]) -> frozenset[str]:
        """The side inputs that the layers ``layer_indices`` ask for."""
        return frozenset(n for i in layer_indices for n in self.layers[i].inputs)

    @classmethod
    def from_layers(
        cls,
        layers: Sequence[LayerSpec | Callable[[], nn.Module]],
        tied: Sequence[TiedWeight] = (),
        *,
        constants: Mapping[str, ConstantFactory] | None = None,
        extras: Sequence[str] = (),
    ) -> PipelineSpec:
        """A user model: LayerSpecs, or bare factories named ``layers.0``, ``layers.1``, ...

        Bare factories are all of kind "block": the first stage then takes whatever the
        first factory's module takes. ``constants``: name -> factory of a tensor shared by
        the layers that ask for it (called with the device, once per stage); ``extras``:
        the names of the per-batch tensors that ``step(..., extras=)`` takes.
        """
        specs = tuple(
            layer if isinstance(layer, LayerSpec) else LayerSpec(f"layers.{i}", "block", layer)
            for i, layer in enumerate(layers)
        )
        for i, layer in enumerate(specs):
            if not callable(layer.build):
                raise SpecError(
                    f"layer {i} ({layer.name!r}) is not a factory: pass a zero-argument callable"
                )
        side = tuple((constants or {}).items())
        return cls(
            specs, tuple(tied), side, (extras,) if isinstance(extras, str) else tuple(extras)
        )

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def num_blocks(self) -> int:
        return sum(1 for layer in self.layers if layer.kind == "block")

    def block_indices(self) -> tuple[int, ...]:
        return tuple(i for i, layer in enumerate(self.layers) if layer.kind == "block")

    def tied_holders(self, stage_layers: Sequence[Sequence[int]]) -> dict[str, tuple[int, ...]]:
        """For each tied weight, the stages (indices into ``stage_layers``) that hold a copy.

        The runtime sums the gradients of a tied weight over these stages' ranks; a weight
        held by one stage only needs nothing.
        """
        holders: dict[str, tuple[int, ...]] = {}
        for tie in self.tied:
            holders[tie.key] = tuple(
                s
                for s, layers in enumerate(stage_layers)
                if tie.owner in layers or tie.copy_layer in layers
            )
        return holders


def model_spec(config: ModelConfig, *, expert_shard: tuple[int, int] | None = None) -> PipelineSpec:
    """The built-in model of ``config`` as pipeline layers: embed, layers.0..N-1, head.

    ``expert_shard`` (rank, size): expert parallelism, this rank's MoE layers hold experts
    ``[rank * E/size, (rank + 1) * E/size)`` only (``pipetrain.parallel.ep`` routes tokens
    to the others); None: every expert.
    """
    embed_cls, block_cls, head_cls = {
        "llama": (LlamaEmbedding, LlamaBlock, LlamaHead),
        "gpt2": (GPT2Embedding, GPT2Block, GPT2Head),
    }[config.family]
    held = None
    if expert_shard is not None:
        rank, size = expert_shard
        per = config.n_experts // size
        held = tuple(range(rank * per, (rank + 1) * per))

    def block(i: int) -> Callable[[], nn.Module]:
        if config.is_moe_block(i):
            return lambda: LlamaBlock(config, moe=MoEFeedForward(config, held))
        return lambda: block_cls(config)

    layers = [LayerSpec("embed", "embedding", lambda: embed_cls(config))]
    layers += [LayerSpec(f"layers.{i}", "block", block(i)) for i in range(config.n_layers)]
    layers.append(LayerSpec("head", "head", lambda: head_cls(config)))
    tied: tuple[TiedWeight, ...] = ()
    if config.tie_embeddings:
        tied = (TiedWeight("embed.tok.weight", 0, "tok.weight", len(layers) - 1, "out.weight"),)
    return PipelineSpec(tuple(layers), tied)
