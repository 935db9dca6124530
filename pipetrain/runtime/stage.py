"""One stage at run time: forward, backward (whole or split into I and W), saved state.

``StageRunner`` wraps a stage's module and keeps, per micro-batch, what the backward
needs. The executor calls it; it knows nothing about ranks or messages.

Splitting the backward (zero-bubble schedules). Every ``nn.Linear`` of the stage gets a
forward that defers its weight products: while a ``WeightGradQueue`` is deferring, the
backward returns the input gradient at once and queues the saved input and output
gradient; ``W`` later runs only those queued weight products. So I + W does the work of
one B, not more. Where it may (``_defers_by_hook``), the linear runs natively on detached
weights with a hook on its output that queues the output gradient (``_hooked_linear``);
under activation checkpointing, autocast or torch.compile, through ``_SplitLinear``, a
custom autograd function that saves its tensors through autograd. Parameters outside
linear layers (norm weights, embeddings) are small and get their gradients during I from
autograd as usual.

Deferring costs time per linear layer (F + I + W over F + B on llama-default's stages:
2-3.5% by the hook, 4-7% through the function), so only the micro-batches whose backward
the schedule splits defer: the runner sets ``WeightGradQueue.recording`` for each forward, and a linear whose
forward ran natively gets a native backward. Early input gradients
(``pipetrain.schedules.early_grads``) split a few backwards of 1F1B; the zero-bubble
schedules split them all.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.models.loss_scale import dividing_loss_by
from pipetrain.runtime.errors import StageMismatchError

__all__ = [
    "LossFn",
    "StageRunner",
    "WeightGradQueue",
    "install_split_backward",
    "token_cross_entropy",
]

# (logits, targets) -> loss summed over the micro-batch's tokens (a 0-d tensor).
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

IGNORE_INDEX = -100


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over tokens; targets equal to -100 do not count."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),  # (B*T, V)
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


# A queued weight-gradient product: (weight, bias, saved input, output gradient).
_Deferred = tuple[nn.Parameter, "nn.Parameter | None", torch.Tensor, torch.Tensor]


class WeightGradQueue:
    """The weight-gradient products that I left for W, per micro-batch of one stage."""

    def __init__(self) -> None:
        # The list that linear backwards append to while an I runs; None outside an I.
        self.active: list[_Deferred] | None = None
        # Whether linear forwards go through ``_SplitLinear`` (a micro-batch whose backward
        # may be split) or run natively. The runner clears it for the micro-batches of a
        # partly split stage that run whole, and for every evaluation forward.
        self.recording = True
        self._by_microbatch: dict[int, list[_Deferred]] = {}

    def begin(self, microbatch: int) -> None:
        self.active = self._by_microbatch.setdefault(microbatch, [])

    def end(self) -> None:
        self.active = None

    def run(self, microbatch: int) -> None:
        """Compute and accumulate the queued weight gradients of one micro-batch (the W)."""
        with torch.no_grad():
            self._run(microbatch)

    def _run(self, microbatch: int) -> None:
        for deferred in self._by_microbatch.pop(microbatch, []):
            _add_weight_grads(*deferred)

    @property
    def pending(self) -> tuple[int, ...]:
        return tuple(self._by_microbatch)

    def clear(self) -> None:
        self.active = None
        self._by_microbatch.clear()


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    # What autograd's AccumulateGrad does, so that I + W matches B bit for bit. Under
    # autocast the product is in the low precision; B's cast node hands AccumulateGrad the
    # gradient in the parameter's dtype, and so does this.
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


def _weight_grads(
    x: torch.Tensor, grad: torch.Tensor, has_bias: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    grad_2d = grad.reshape(-1, grad.shape[-1])  # (N, out)
    x_2d = x.reshape(-1, x.shape[-1])  # (N, in)
    grad_weight = grad_2d.t().mm(x_2d)  # (out, in)
    return grad_weight, (grad_2d.sum(0) if has_bias else None)


def _add_weight_grads(
    weight: nn.Parameter, bias: nn.Parameter | None, x: torch.Tensor, grad: torch.Tensor
) -> None:
    """Accumulate one linear layer's weight (and bias) gradient from its saved input and
    output gradient: a queued product at W, or at once in a whole B."""
    grad_weight, grad_bias = _weight_grads(x, grad, bias is not None)
    _accumulate(weight, grad_weight)
    if bias is not None and grad_bias is not None:
        _accumulate(bias, grad_bias)


class _SplitLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        queue: WeightGradQueue,
    ) -> torch.Tensor:
        device = x.device.type
        if torch.is_autocast_enabled(device):
            # What autocast does to F.linear, done by hand so that backward sees the same
            # low-precision operands that B's autograd graph keeps (the casts' backward then
            # returns fp32 gradients: autograd casts grad_x, _accumulate the weight's).
            dtype = torch.get_autocast_dtype(device)
            x, weight_op = x.to(dtype), weight.to(dtype)
            bias_op = None if bias is None else bias.to(dtype)
        else:
            weight_op, bias_op = weight, bias
        ctx.save_for_backward(x, weight_op)
        ctx.weight = weight
        ctx.bias = bias
        ctx.queue = queue
        with torch.autocast(device, enabled=False):
            return F.linear(x, weight_op, bias_op)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight_op = ctx.saved_tensors
        bias = ctx.bias
        grad = grad.to(weight_op.dtype)
        grad_x = (
            grad.matmul(weight_op) if ctx.needs_input_grad[0] else None
        )  # (..., out) @ (out, in)
        wants_weight = ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[2])
        if not wants_weight:
            return grad_x, None, None, None
        active = ctx.queue.active
        if active is not None:
            active.append((ctx.weight, bias, x, grad))
            return grad_x, None, None, None
        grad_weight, grad_bias = _weight_grads(x, grad, bias is not None)
        return grad_x, grad_weight, grad_bias, None


def _defers_by_hook(x: torch.Tensor, weight: nn.Parameter, bias: nn.Parameter | None) -> bool:
    """Whether ``_hooked_linear`` may stand in for ``_SplitLinear`` here.

    It keeps the linear's input in a closure, outside autograd's saved tensors, so not
    where saved tensors are packed by hooks (activation checkpointing would keep what it
    frees, offloading would not move it); not under autocast (W must use the
    low-precision operands B uses); not while torch.compile traces; and only where the
    output needs a gradient through the input (else the weights' would not flow)."""
    return (
        not torch.compiler.is_compiling()
        and x.requires_grad
        and weight.requires_grad
        and (bias is None or bias.requires_grad)
        and torch.is_grad_enabled()
        and not torch.is_autocast_enabled(x.device.type)
        and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    )


def _hooked_linear(
    x: torch.Tensor, weight: nn.Parameter, bias: nn.Parameter | None, queue: WeightGradQueue
) -> torch.Tensor:
    """``_SplitLinear`` without its Python per layer: the linear on detached weights, so
    that autograd computes only the input's gradient, natively, and a hook on the output
    that receives the output gradient and queues the weight products.

    Measured on llama-default's stages (8 sequences, one thread, 84 paired micro-batches):
    F + I + W over F + B 1.035 and 1.018, against 1.068 and 1.042 through the function.
    """
    version = x._version
    out = F.linear(x, weight.detach(), None if bias is None else bias.detach())

    def deferred(grad: torch.Tensor) -> None:
        if x._version != version:
            # What autograd says of a saved tensor changed in place; W would be wrong.
            raise RuntimeError(
                "the input of a linear layer was modified in place after its forward, "
                "which its weight gradient needs: replace the in-place operation (x.add_(...) "
                "-> x = x + ...), or run this stage without split backwards"
            )
        active = queue.active
        if active is not None:
            active.append((weight, bias, x, grad))
            return
        # A whole B of a recorded micro-batch: its weight gradients now, as B's would be.
        _add_weight_grads(weight, bias, x, grad)

    out.register_hook(deferred)  # type: ignore[no-untyped-call]
    return out


def _split_forward(linear: nn.Linear, queue: WeightGradQueue, x: torch.Tensor) -> torch.Tensor:
    if not queue.recording:
        return F.linear(x, linear.weight, linear.bias)  # what nn.Linear.forward does
    # nn.Linear declares them as tensors; they are its parameters.
    weight, bias = cast(nn.Parameter, linear.weight), cast("nn.Parameter | None", linear.bias)
    if _defers_by_hook(x, weight, bias):
        return _hooked_linear(x, weight, bias, queue)
    out: torch.Tensor = _SplitLinear.apply(x, weight, bias, queue)  # type: ignore[no-untyped-call]
    return out


def install_split_backward(module: nn.Module) -> WeightGradQueue:
    """Route every nn.Linear of ``module`` through ``_SplitLinear``; returns their queue."""
    queue = WeightGradQueue()
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            sub.forward = functools.partial(_split_forward, sub, queue)  # type: ignore[method-assign]
    return queue


@dataclass
class _Saved:
    """What the backward of one micro-batch needs."""

    inputs: tuple[torch.Tensor, ...]  # the stage inputs, leaves that collect the input grads
    outputs: tuple[torch.Tensor, ...]  # floating-point outputs (the loss on a last stage)


def _as_tuple(value: Any) -> tuple[torch.Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


def _vocab_parallel(outputs: tuple[Any, ...]) -> contextlib.AbstractContextManager[None]:
    """torch's ``loss_parallel`` where a stage's logits are sharded over the vocabulary
    (tensor parallelism): cross-entropy on the shards, forward and backward."""
    if any(_is_dtensor(o) for o in outputs):
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def _is_dtensor(value: object) -> bool:
    # No DTensor exists unless its module was imported, and importing it costs about 1 s
    # of every rank's start-up: runs without tensor parallelism do not pay it here.
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(value, dtensor.DTensor)


class StageRunner:
    """Forward and backward of one (virtual) stage, micro-batch by micro-batch."""

    def __init__(
        self,
        stage: int,
        module: nn.Module,
        *,
        is_first: bool,
        is_last: bool,
        loss_fn: LossFn,
        split_backward: bool,
        split_only: frozenset[int] | None = None,
    ) -> None:
        """``split_backward``: some backwards of this stage run as I and W; ``split_only``:
        the micro-batches whose do (None: every one)."""
        self.stage = stage
        self.module = module
        self.is_first = is_first
        self.is_last = is_last
        self.loss_fn = loss_fn
        self.queue = install_split_backward(module) if split_backward else None
        # The per-batch side inputs the stage's layers take (StageModule.extra_names).
        self.extra_names: frozenset[str] = getattr(module, "extra_names", frozenset())
        self._split_only = split_only
        self.saved: dict[int, _Saved] = {}
        # Sum over this stage's micro-batches of loss / batch tokens (0-d, detached).
        self.loss_sum: torch.Tensor | None = None

    def forward(
        self,
        microbatch: int,
        inputs: tuple[torch.Tensor, ...],
        target: torch.Tensor | None,
        denominator: float,
        training: bool,
        extras: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Run the stage; returns its outputs (nothing on a last stage, which keeps the loss).

        ``extras``: this micro-batch's side inputs, which the layers take by name."""
        self._record(microbatch, training)
        extras = extras or {}
        if not training:
            with torch.no_grad(), dividing_loss_by(denominator):
                outputs = _as_tuple(self.module(*inputs, **extras))
                if self.is_last:
                    self._add_loss(self._loss(outputs, target, denominator))
                    return ()
                return self._boundary(outputs)
        # Inputs from another stage become leaves, so that their gradient is the one to send.
        leaves = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in inputs)
        # Layers with a loss of their own (experts' balancing) weigh it on the main loss's scale.
        with dividing_loss_by(denominator):
            outputs = _as_tuple(self.module(*leaves, **extras))
        if self.is_last:
            loss = self._loss(outputs, target, denominator)
            self._add_loss(loss.detach())
            self.saved[microbatch] = _Saved(leaves, (loss,))
            return ()
        self._boundary(outputs)
        # The next stage returns a gradient for every floating-point output (zeros for those
        # that carry none), so all of them are kept to match the gradients by position.
        self.saved[microbatch] = _Saved(leaves, tuple(o for o in outputs if o.is_floating_point()))
        return outputs

    def _boundary(self, outputs: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
        """The outputs that cross to the next stage, which must all be tensors."""
        for value in outputs:
            if not isinstance(value, torch.Tensor):
                raise StageMismatchError(
                    f"stage {self.stage} returned a {type(value).__name__} for the next stage: "
                    f"only tensors cross a stage boundary; return a tensor or a tuple of tensors"
                )
        return outputs

    def _loss(
        self, outputs: tuple[torch.Tensor, ...], target: torch.Tensor | None, denominator: float
    ) -> torch.Tensor:
        if target is None:
            raise StageMismatchError(
                f"stage {self.stage} is a last stage but got no targets: pass targets to step()"
            )
        with _vocab_parallel(outputs):
            return self.loss_fn(outputs[0], target) / denominator

    def _add_loss(self, loss: torch.Tensor) -> None:
        if _is_dtensor(loss):  # a loss of sharded logits, replicated over tp
            loss = loss.full_tensor()  # type: ignore[attr-defined]
        self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss

    def backward(
        self, microbatch: int, grads: tuple[torch.Tensor, ...] | None, weights: bool
    ) -> tuple[torch.Tensor, ...]:
        """B (``weights`` true) or I: gradients into the stage; returns the input gradients.

        ``grads`` are the gradients of the outputs from the next stage (None on a last
        stage, whose output is the loss).
        """
        saved = self.saved.pop(microbatch)
        if grads is not None:
            self._check_grads(microbatch, saved.outputs, grads)
        # As in this micro-batch's forward: a recomputed forward (activation checkpointing)
        # must take the same path through the linear layers.
        self._record(microbatch, True)
        if self.queue is not None and not weights:
            self.queue.begin(microbatch)
        outputs: tuple[torch.Tensor, ...] = saved.outputs
        if grads is not None:
            pairs = [(o, g) for o, g in zip(saved.outputs, grads, strict=True) if o.requires_grad]
            outputs, grads = tuple(o for o, _ in pairs), tuple(g for _, g in pairs)
        try:
            with _vocab_parallel(outputs):
                torch.autograd.backward(outputs, grads)
        finally:
            if self.queue is not None:
                self.queue.end()
        if self.is_first:
            return ()
        return tuple(
            t.grad if t.grad is not None else torch.zeros_like(t)
            for t in saved.inputs
            if t.requires_grad
        )

    def split_as(self, split_backward: bool, split_only: frozenset[int] | None) -> None:
        """Split the backwards another schedule of this stage splits (another micro-batch
        count: ``Pipeline.reschedule``); a stage split before keeps its queue, unused."""
        if split_backward and self.queue is None:
            self.queue = install_split_backward(self.module)
        self._split_only = split_only if split_backward else frozenset()

    def _record(self, microbatch: int, training: bool) -> None:
        # Evaluation runs natively on every stage: it has no backward to split.
        if self.queue is not None:
            self.queue.recording = training and (
                self._split_only is None or microbatch in self._split_only
            )

    def weight(self, microbatch: int) -> None:
        """W: the weight gradients that the I of this micro-batch left queued."""
        if self.queue is None:
            raise StageMismatchError(
                f"stage {self.stage} runs W{microbatch} but its backward was not split"
            )
        self.queue.run(microbatch)

    def _check_grads(
        self, microbatch: int, outputs: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor, ...]
    ) -> None:
        got = [(tuple(g.shape), g.dtype) for g in grads]
        want = [(tuple(o.shape), o.dtype) for o in outputs]
        if got != want:
            raise StageMismatchError(
                f"stage {self.stage + 1} sent gradients {got} for micro-batch {microbatch}, but "
                f"stage {self.stage} produced outputs {want}: the stages disagree on the "
                f"boundary; check that stage {self.stage + 1} takes every "
                f"output of stage {self.stage} as an input"
            )

    def reset(self) -> None:
        """Forget a step's state (after an error, or before the next step)."""
        self.saved.clear()
        self.loss_sum = None
        if self.queue is not None:
            self.queue.clear()
