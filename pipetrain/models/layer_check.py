"""Every layer of a spec checked once, on the meta device, before any stage is built.

Each rank builds only its own layers, so a mistake in another rank's layers would show up
there alone, at the first forward, as a peer lost here. Building every layer on the meta
device costs no memory and a few milliseconds per layer, and gives every rank the same
one-line error at ``build_pipeline``: a side input that the forward cannot take or needs
without asking for it, and global names that two layers would share.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from pipetrain.models.spec import PipelineSpec, SpecError
from pipetrain.models.stage import qualified

__all__ = ["check_layers"]


def check_layers(spec: PipelineSpec) -> tuple[str, ...]:
    """The model's state names (parameters and persistent buffers, by global name), in
    layer order, after checking each layer's side inputs and that no name is shared."""
    owners: dict[str, int] = {}
    top: dict[str, int] = {}  # first part of every global name -> the layer that holds it
    for i, layer in enumerate(spec.layers):
        with torch.device("meta"):
            module = layer.build()
        _check_signature(spec, i, module)
        heads = {name for name, _ in module.named_children()} if not layer.name else {layer.name}
        for head in sorted({h.split(".")[0] for h in heads}):  # the same line every run
            other = top.setdefault(head, i)
            if other != i and (not layer.name or not spec.layers[other].name):
                raise SpecError(
                    f"layers {other} and {i} both put {head!r} at the top level: give one of "
                    f"them a prefix (LayerSpec name)"
                )
        for local in module.state_dict():
            name = qualified(layer.name, local)
            if owners.setdefault(name, i) != i:
                raise SpecError(
                    f"layers {owners[name]} and {i} both hold {name!r}: give one of them "
                    f"another prefix"
                )
    return tuple(owners)


def _check_signature(spec: PipelineSpec, index: int, module: nn.Module) -> None:
    """The side inputs of layer ``index`` and its forward's keyword arguments agree."""
    layer = spec.layers[index]
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):  # a forward without a signature (a builtin): unchecked
        return
    where = f"layer {index} ({layer.name!r}, {type(module).__name__})"
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    named = {p.name for p in params if p.kind is not inspect.Parameter.VAR_POSITIONAL}
    for name in layer.inputs:
        if name not in named and not takes_any:
            raise SpecError(
                f"{where} asks for side input {name!r}, but its forward takes no argument of "
                f"that name: add it to forward's keyword arguments or drop it from inputs="
            )
    declared = {name for name, _ in spec.constants} | set(spec.extras)
    for p in params:
        needed = p.default is inspect.Parameter.empty and p.name not in layer.inputs
        if needed and (p.kind is inspect.Parameter.KEYWORD_ONLY or p.name in declared):
            also = "" if p.name in declared else " and declare it in constants= or extras="
            raise SpecError(
                f"{where}: its forward needs {p.name!r}, which its LayerSpec does not ask "
                f"for: pass inputs=({p.name!r}, ...){also}"
            )
