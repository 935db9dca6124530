"""Build one pipeline stage (or the whole model) with split-independent weights.

Each layer is built with its parameters on the meta device (no memory) and its buffers
for real on the CPU (a RoPE table computed in ``__init__`` keeps its values), materialised
on the CPU, initialised from a generator seeded by (seed, global layer index), then moved
to the run's device and dtype. Drawing on the CPU keeps the weights identical across devices; materialising one
layer at a time keeps the extra host memory of a GPU run to one layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from pipetrain.errors import InputError
from pipetrain.models.init import layer_generator, layer_seed
from pipetrain.models.spec import LayerSpec, PipelineSpec, SpecError, TiedWeight

__all__ = ["StageError", "StageModule", "build_full_model", "build_stage", "qualified"]


class StageError(InputError):
    """Layer indices that do not form a stage of the given model."""


def qualified(prefix: str, local: str) -> str:
    """The global name of ``local`` in the layer named ``prefix`` ("" = top level)."""
    return f"{prefix}.{local}" if prefix else local


def _attach(root: nn.Module, dotted: str, module: nn.Module) -> None:
    """Register ``module`` at ``root.<dotted>``, creating empty containers on the way; a
    layer named "" registers its submodules at the top."""
    if not dotted:
        if module._parameters or module._buffers:
            own = next(iter([*module._parameters, *module._buffers]))
            raise SpecError(
                f"a top-level layer ({type(module).__name__}) holds {own!r} itself: put it in "
                f"a submodule (its name is then the submodule's), or give the layer a prefix"
            )
        for name, top in module.named_children():
            if hasattr(root, name):
                raise SpecError(
                    f"two layers put {name!r} at the top level: give one of them a prefix"
                )
            root.add_module(name, top)
        return
    *parents, leaf = dotted.split(".")
    parent = root
    for part in parents:
        child = parent._modules.get(part)
        if child is None:
            child = nn.Module()
            parent.add_module(part, child)
        parent = child
    parent.add_module(leaf, module)


def _parameter(module: nn.Module, dotted: str, layer_name: str) -> nn.Parameter:
    try:
        return module.get_parameter(dotted)
    except AttributeError:
        raise SpecError(
            f"tied weight names {layer_name}.{dotted}, which is not a parameter of that layer: "
            "fix the TiedWeight's parameter name"
        ) from None


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device; buffers stay real.

    (accelerate's ``init_empty_weights(include_buffers=False)``.) A parameter's CPU tensor
    exists only between its creation and its registration, untouched (``torch.empty``).
    """
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if type(param) is nn.Parameter and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _set_buffer(module: nn.Module, dotted: str, value: torch.Tensor) -> None:
    parent, _, leaf = dotted.rpartition(".")
    module.get_submodule(parent)._buffers[leaf] = value


def _materialise_with_init(module: nn.Module, layer: LayerSpec, generator: torch.Generator) -> None:
    """``to_empty`` on the CPU, the buffers built in ``__init__`` put back, then
    ``init_weights``; a buffer that was born on the meta device (computed from a
    parameter) must be filled by ``init_weights``: one still NaN is refused."""
    buffers = dict(module.named_buffers(remove_duplicate=False))
    module.to_empty(device="cpu")
    unset = []
    for name, value in buffers.items():
        if value.device.type != "meta":
            _set_buffer(module, name, value)
        elif value.is_floating_point():
            module.get_buffer(name).fill_(float("nan"))
            unset.append(name)
    module.init_weights(generator)  # type: ignore[operator]
    for name in unset:
        if module.get_buffer(name).isnan().any():
            raise SpecError(
                f"layer {layer.name!r}: buffer {name!r} is computed from a parameter while the "
                f"layer is built on the meta device, and init_weights does not fill it: "
                f"compute it in init_weights (or from plain tensors in __init__)"
            )


def _materialise_layer(layer: LayerSpec, *, seed: int, index: int) -> nn.Module:
    """Build one layer on the CPU with weights that depend only on (seed, index)."""
    # The caller's global RNG is left as it was, whatever __init__ draws.
    with torch.random.fork_rng(devices=[]), _parameters_on_meta():
        module = layer.build()
    if callable(getattr(module, "init_weights", None)):
        _materialise_with_init(module, layer, layer_generator(seed, index))
        return module
    # A user layer without init_weights: build it for real under a seeded global RNG, so its
    # own default initialisation is reproducible and independent of the other layers.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(layer_seed(seed, index))
        return layer.build().to("cpu")


class StageModule(nn.Module):
    """Some consecutive layers of a pipeline, registered under their global names.

    ``forward`` runs them in order. The first stage takes token ids (B, T) int64, later
    stages hidden states (B, T, C); the last stage returns logits (B, T, V). Each layer
    also gets, as keyword arguments, the side inputs it asks for: the stage's
    ``constants`` (built once, when the stage is) and the per-batch ``extras`` passed to
    ``forward`` as keyword arguments.
    """

    def __init__(
        self,
        spec: PipelineSpec,
        layer_indices: Sequence[int],
        layers: Sequence[nn.Module],
        constants: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.layer_indices: tuple[int, ...] = tuple(layer_indices)
        self.layer_names: tuple[str, ...] = tuple(spec.layers[i].name for i in self.layer_indices)
        for name, module in zip(self.layer_names, layers, strict=True):
            _attach(self, name, module)
        # A tuple is not registered by nn.Module: the layers stay registered once, by name.
        self._run: tuple[nn.Module, ...] = tuple(layers)
        self._wants = tuple(spec.layers[i].inputs for i in self.layer_indices)
        # Not buffers: they are no state of the model, and checkpoints never hold them.
        self.constants: dict[str, torch.Tensor] = dict(constants or {})
        # The per-batch side inputs that this stage's layers ask for.
        self.extra_names = spec.side_inputs(self.layer_indices) - self.constants.keys()

    @property
    def is_first(self) -> bool:
        return 0 in self.layer_indices

    @property
    def is_last(self) -> bool:
        return len(self.spec) - 1 in self.layer_indices

    def forward(self, *inputs: torch.Tensor, **extras: torch.Tensor) -> Any:
        # A layer may return several tensors (a tuple): the next layer gets them as arguments.
        x: Any = inputs if len(inputs) != 1 else inputs[0]
        for layer, wants in zip(self._run, self._wants, strict=True):
            side = {n: self._side(n, extras) for n in wants}
            x = layer(*x, **side) if isinstance(x, tuple) else layer(x, **side)
        return x

    def _side(self, name: str, extras: Mapping[str, torch.Tensor]) -> torch.Tensor:
        found = self.constants.get(name, extras.get(name))
        if found is None:
            raise StageError(f"a layer of this stage takes {name!r}: pass it in extras")
        return found

    def tied_parameters(self) -> dict[str, nn.Parameter]:
        """Canonical key -> this stage's copy of each tied weight it holds.

        Where the owner and the copy layer are both here they are one tensor, listed once.
        """
        found: dict[str, nn.Parameter] = {}
        for tie in self.spec.tied:
            for index, param in ((tie.owner, tie.owner_param), (tie.copy_layer, tie.copy_param)):
                if index in self.layer_indices:
                    name = self.spec.layers[index].name
                    found[tie.key] = _parameter(self, qualified(name, param), name)
                    break
        return found


def _check_indices(spec: PipelineSpec, layer_indices: Sequence[int]) -> tuple[int, ...]:
    indices = tuple(layer_indices)
    if not indices:
        raise StageError(
            "a stage needs at least one layer: give it a non-empty range of layer indices"
        )
    n = len(spec)
    for index in indices:
        if not isinstance(index, int) or not 0 <= index < n:
            raise StageError(f"layer index {index!r} is outside 0..{n - 1} of this {n}-layer model")
    if indices != tuple(range(indices[0], indices[0] + len(indices))):
        raise StageError(
            f"stage layers {list(indices)} are not consecutive: a stage is a contiguous range of layers"
        )
    return indices


def build_stage(
    spec: PipelineSpec,
    layer_indices: Sequence[int],
    *,
    seed: int,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
) -> StageModule:
    """Build the layers ``layer_indices`` of ``spec`` on ``device``, weights seeded per layer."""
    indices = _check_indices(spec, layer_indices)
    constants = _constants(spec, indices, torch.device(device))
    layers = [
        _materialise_layer(spec.layers[i], seed=seed, index=i).to(device=device, dtype=dtype)
        for i in indices
    ]
    by_index = dict(zip(indices, layers, strict=True))
    for tie in spec.tied:
        if tie.copy_layer not in by_index:
            continue
        copy_layer = by_index[tie.copy_layer]
        copy = _parameter(copy_layer, tie.copy_param, spec.layers[tie.copy_layer].name)
        if tie.owner in by_index:
            owner = _parameter(by_index[tie.owner], tie.owner_param, spec.layers[tie.owner].name)
            _check_tied_shapes(spec, tie, owner, copy)
            parent, _, leaf = tie.copy_param.rpartition(".")
            setattr(copy_layer.get_submodule(parent), leaf, owner)
        else:
            # The owner lives on another stage: start from the owner's exact initial value.
            owner_layer = _materialise_layer(spec.layers[tie.owner], seed=seed, index=tie.owner)
            source = _parameter(owner_layer, tie.owner_param, spec.layers[tie.owner].name)
            _check_tied_shapes(spec, tie, source, copy)
            with torch.no_grad():
                copy.copy_(source)
    return StageModule(spec, indices, layers, constants)


def _constants(
    spec: PipelineSpec, indices: Sequence[int], device: torch.device
) -> dict[str, torch.Tensor]:
    """The constants that the layers ``indices`` ask for, each built once on ``device``."""
    wanted = spec.side_inputs(indices)
    built = {}
    for name, factory in spec.constants:
        if name in wanted:
            value = factory(device)
            if not isinstance(value, torch.Tensor):
                raise SpecError(
                    f"constant {name!r} built a {type(value).__name__}: return a tensor"
                )
            built[name] = value
    return built


def _check_tied_shapes(
    spec: PipelineSpec, tie: TiedWeight, owner: nn.Parameter, copy: nn.Parameter
) -> None:
    # One tensor serves both layers (or the copy starts as the owner's): the shapes must agree.
    if owner.shape != copy.shape:
        raise SpecError(
            f"tied weight {tie.key!r}: {spec.layers[tie.owner].name}.{tie.owner_param} is "
            f"{tuple(owner.shape)} but {spec.layers[tie.copy_layer].name}.{tie.copy_param} is "
            f"{tuple(copy.shape)}: tie parameters of one shape"
        )


def build_full_model(
    spec: PipelineSpec, *, seed: int, device: torch.device | str, dtype: torch.dtype = torch.float32
) -> StageModule:
    """Every layer on one device: the single-process reference."""
    return build_stage(spec, range(len(spec)), seed=seed, device=device, dtype=dtype)
