"""Measure each pipeline layer on the run's device: times, parameter and activation bytes.

Each layer is built alone (``build_stage`` with one index) and fed the previous layer's
output for one micro-batch, so the inputs have real shapes and values. Per layer:

- forward: the fastest of a few timed forwards, recording the graph as training does;
- backward: on one retained graph, the full backward (input and parameters) and the
  input-only backward (``torch.autograd.grad`` w.r.t. the input alone); the weight part is
  the difference, which is what a split backward that does not redo the input work costs;
- activation bytes: the storages autograd saves for the backward, seen through
  ``saved_tensors_hooks``, parameters excluded (on CUDA, the larger of that and the growth
  of allocated memory over the forward);
- deferred bytes: the outputs of the layer's linears, whose gradients a split backward
  holds from I to W (the gradient has its output's shape).

Everything is divided by the micro-batch size: costs are per sample.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.models.spec import PipelineSpec
from pipetrain.models.stage import build_stage
from pipetrain.partition.balance import LayerCost

__all__ = ["available_bytes", "default_device", "profile_bytes", "profile_layers"]


def default_device() -> torch.device:
    """cuda when there is one, else cpu: chosen at run time, never assumed."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def available_bytes(device: torch.device) -> float | None:
    """Memory free for a profile on ``device`` now (None where it cannot be told)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024  # given in KiB
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, AttributeError):
        return None


def profile_bytes(costs: Sequence[LayerCost], microbatch_size: int) -> tuple[float, str]:
    """About the most memory profiling one layer takes, and that layer's name.

    Per layer, from estimated costs: its parameters and their gradients, and three times
    one micro-batch's saved activations (the retained graph, the forward that counts what
    it saves, and the gradients of the backward; for the head, the logits, their
    log-softmax and its gradient).
    """
    need = [
        (2.0 * c.param_bytes + 3.0 * c.activation_bytes_per_sample * microbatch_size, c.name)
        for c in costs
    ]
    return max(need)


def _timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Fastest of ``repeats`` timed calls after one untimed warm-up.

    The minimum, not the mean: on a shared machine the noise only ever adds time.
    """
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - start)
    return min(samples)


def _kept_bytes(
    layer: nn.Module, x: torch.Tensor, device: torch.device, is_head: bool, seed: int
) -> tuple[float, float, float]:
    """Bytes of the distinct storages autograd keeps for this layer's backward, of the
    outputs of its ``nn.Linear`` layers, and of the kept storages that are no linear's
    input, from one forward.

    After the head the loss is included: its log-softmax lives on the last stage too. The
    linears' outputs are what the output gradients queued by a split backward
    (``pipetrain.runtime.stage``) take from I to W; their inputs are what W needs of the
    kept tensors, the rest going with I's graph.
    """
    param_storages = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, int] = {}
    inputs: set[int] = set()
    outputs = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    def count(_module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        nonlocal outputs
        outputs += output.numel() * output.element_size()
        inputs.add(args[0].untyped_storage().data_ptr())

    linears = [m for m in layer.modules() if isinstance(m, nn.Linear)]
    handles = [m.register_forward_hook(count) for m in linears]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = layer(x)
            loss = _output_loss(y, True, torch.Generator().manual_seed(seed)) if is_head else None
    finally:
        for handle in handles:
            handle.remove()
    saved = float(sum(seen.values()))
    freed = float(sum(n for ptr, n in seen.items() if ptr not in inputs))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        # The output itself is the next stage's input, sent away: not this layer's memory.
        grown = torch.cuda.memory_allocated(device) - before - y.untyped_storage().nbytes()
        saved = max(saved, float(grown))
    del y, loss
    return saved, float(outputs), freed


def _output_loss(y: torch.Tensor, is_head: bool, generator: torch.Generator) -> torch.Tensor:
    """What the backward starts from: the LM loss after the head, else a fixed random cotangent."""
    if is_head and y.dim() == 3:
        targets = torch.randint(0, y.shape[-1], y.shape[:2], generator=generator).to(y.device)
        return F.cross_entropy(y.flatten(0, 1).float(), targets.flatten())
    cotangent = torch.randn(y.shape, generator=generator).to(device=y.device, dtype=y.dtype)
    return (y * cotangent).sum()


def _measure(
    layer: nn.Module, x_in: torch.Tensor, is_head: bool, seed: int, dev: torch.device, repeats: int
) -> tuple[float, float, float, tuple[float, float, float]]:
    """Seconds of forward, full backward and input-only backward; saved, linear-output
    and freed-at-I bytes (``_kept_bytes``)."""
    params = list(dict.fromkeys(layer.parameters()))
    # With autograd recording, as in training: saving tensors for the backward costs time too.
    forward = _timed(lambda: layer(x_in), dev, repeats)
    # One forward with a graph, then the backward alone, repeated on the retained graph.
    loss = _output_loss(layer(x_in), is_head, torch.Generator().manual_seed(seed))
    wrt = [x_in, *params] if x_in.requires_grad else params
    full = _timed(
        lambda: torch.autograd.grad(loss, wrt, retain_graph=True, allow_unused=True), dev, repeats
    )
    b_input = 0.0
    if x_in.requires_grad:
        b_input = _timed(lambda: torch.autograd.grad(loss, [x_in], retain_graph=True), dev, repeats)
        b_input = min(b_input, full)
    return forward, full, b_input, _kept_bytes(layer, x_in, dev, is_head, seed)


def profile_layers(
    spec: PipelineSpec,
    example_input: torch.Tensor,
    *,
    seed: int = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    repeats: int = 3,
    threads: int | None = None,
) -> list[LayerCost]:
    """One ``LayerCost`` per layer of ``spec``, measured with ``example_input`` as one micro-batch.

    ``example_input`` is what the first layer takes (token ids (B, T) for the built-in
    models); B, the micro-batch size, divides every figure. ``threads`` sets torch's CPU
    threads while measuring (a pipeline rank on a shared CPU usually gets one) and restores
    the previous number afterwards.
    """
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _profile(spec, example_input, seed, device, dtype, repeats)
    finally:
        torch.set_num_threads(previous)


def _profile(
    spec: PipelineSpec,
    example_input: torch.Tensor,
    seed: int,
    device: torch.device | str | None,
    dtype: torch.dtype,
    repeats: int,
) -> list[LayerCost]:
    dev = torch.device(device) if device is not None else default_device()
    samples = example_input.shape[0]
    x = example_input.to(dev)
    costs: list[LayerCost] = []
    for index, layer_spec in enumerate(spec.layers):
        layer = build_stage(spec, [index], seed=seed, device=dev, dtype=dtype)
        params = list(dict.fromkeys(layer.parameters()))
        is_head = layer_spec.kind == "head"
        x_in = x.detach().requires_grad_(x.is_floating_point())

        forward, full, b_input, (act, held, freed) = _measure(
            layer, x_in, is_head, seed, dev, repeats
        )
        # A tied copy built alone holds its own tensor; a stage that also holds the owner
        # does not (``LayerCost.tied_to``).
        tie = next((t for t in spec.tied if t.copy_layer == index), None)
        tied = None if tie is None else layer.get_parameter(f"{layer_spec.name}.{tie.copy_param}")
        costs.append(
            LayerCost(
                name=layer_spec.name,
                kind=layer_spec.kind,
                forward=forward / samples,
                backward=full / samples,
                backward_input=b_input / samples,
                backward_weight=(full - b_input) / samples,
                params=sum(p.numel() for p in params),
                param_bytes=sum(p.numel() * p.element_size() for p in params),
                activation_bytes_per_sample=act / samples,
                deferred_bytes_per_sample=held / samples,
                freed_at_input_bytes_per_sample=freed / samples,
                tied_to=None if tie is None else tie.owner,
                tied_params=0 if tied is None else tied.numel(),
                tied_param_bytes=0 if tied is None else tied.numel() * tied.element_size(),
            )
        )
        with torch.no_grad():
            x = layer(x_in)
    return costs
