"""A user's own Llama-style model through ``PipelineSpec.from_layers``, without traps:
side inputs declared in the spec (a RoPE table built once per stage, position ids passed
with the batch), buffers of meta-built layers initialised, an explicit loss reduction,
top-level parameter names, and ``state_dict`` / ``load_state_dict`` by global name.

Every pipeline here runs its ranks in one process (the debug mode), with the numbers of a
multi-process run.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.models import LayerSpec, PipelineSpec, SpecError, build_full_model, build_stage
from pipetrain.runtime import PipelineInputError, build_pipeline

V, C, T, MAX_T = 32, 8, 6, 16


def rope_table(device: torch.device) -> torch.Tensor:
    """(MAX_T, C) angles' cosines: the shared constant of every block."""
    positions = torch.arange(MAX_T, device=device, dtype=torch.float32)[:, None]
    freqs = torch.arange(C, device=device, dtype=torch.float32)[None, :] / C
    return torch.cos(positions * freqs)


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(V, C)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(ids)  # (B, T, C)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(C, C)

    def forward(self, x: torch.Tensor, *, rope: torch.Tensor, positions: torch.Tensor) -> Any:
        return x + torch.tanh(self.wq(x * rope[positions]))  # rope[positions]: (B, T, C)


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(C)
        self.output = nn.Linear(C, V, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(x))  # (B, T, V)


def user_spec(blocks: int = 3) -> PipelineSpec:
    layers = [LayerSpec("", "embedding", Embed)]
    layers += [
        LayerSpec(f"layers.{i}", "block", Block, inputs=("rope", "positions"))
        for i in range(blocks)
    ]
    layers.append(LayerSpec("", "head", Head))
    return PipelineSpec.from_layers(layers, constants={"rope": rope_table}, extras=("positions",))


def batch(seed: int = 0, b: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (b, T + 1), generator=g)
    positions = torch.randint(0, MAX_T, (b, T), generator=g)
    return ids[:, :-1], ids[:, 1:], positions


def pipe_of(spec: PipelineSpec, **kw: Any) -> Any:
    options: dict[str, Any] = {"schedule": "1f1b", "microbatches": 2, "ranks": 2, "seed": 0}
    options.update(kw)
    return build_pipeline(spec, device="cpu", **options)  # type: ignore[arg-type]


# ----------------------------------------------------------------- trap 1: side inputs
def test_side_inputs_reach_every_layer_that_declares_them() -> None:
    spec = user_spec()
    inputs, targets, positions = batch()
    pipe = pipe_of(spec)
    result = pipe.step(inputs, targets, extras={"positions": positions})
    full = build_full_model(spec, seed=0, device="cpu")
    logits = full(inputs, positions=positions)
    want = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
    assert result.loss == pytest.approx(float(want.detach()), rel=1e-6)
    want.backward()
    got = dict(pipe.named_parameters())
    for name, p in full.named_parameters():
        torch.testing.assert_close(got[name].grad, p.grad, rtol=1e-5, atol=1e-6)
    assert pipe.eval_loss(inputs, targets, extras={"positions": positions}) == pytest.approx(
        result.loss, rel=1e-6
    )


def test_a_layer_asking_for_an_undeclared_input_is_refused_with_the_spec() -> None:
    with pytest.raises(SpecError, match=r"layers\.0.*'rope'.*constants=.*extras="):
        PipelineSpec.from_layers([LayerSpec("layers.0", "block", Block, inputs=("rope",))])


def test_a_forward_that_needs_an_input_its_layer_spec_does_not_ask_for_is_refused() -> None:
    spec = PipelineSpec.from_layers(
        [LayerSpec("embed", "embedding", Embed), LayerSpec("layers.0", "block", Block)],
        constants={"rope": rope_table},
        extras=("positions",),
    )
    with pytest.raises(SpecError, match=r"layers\.0.*'rope'.*inputs="):
        pipe_of(spec, ranks=2)


def test_a_missing_or_unknown_extra_is_one_line_before_the_step() -> None:
    inputs, targets, positions = batch()
    pipe = pipe_of(user_spec())
    with pytest.raises(PipelineInputError, match=r"extras.*'positions'"):
        pipe.step(inputs, targets)
    with pytest.raises(PipelineInputError, match=r"'mask'.*not declared"):
        pipe.step(inputs, targets, extras={"positions": positions, "mask": positions})


# ----------------------------------------------------------------- trap 2: buffers
class Buffered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(C, C)
        self.register_buffer("table", torch.arange(C, dtype=torch.float32) + 1.0)

    def init_weights(self, generator: torch.Generator) -> None:
        nn.init.normal_(self.lin.weight, generator=generator)
        nn.init.zeros_(self.lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.table


class FromWeight(Buffered):
    def __init__(self) -> None:
        super().__init__()
        # Computed from a parameter: on the meta device while the layer is built.
        self.register_buffer("scale", self.lin.weight.detach().sum(0))


def test_buffers_of_a_layer_with_init_weights_are_initialised() -> None:
    stage = build_stage(PipelineSpec.from_layers([Buffered]), [0], seed=0, device="cpu")
    torch.testing.assert_close(
        stage.get_buffer("layers.0.table"), torch.arange(C, dtype=torch.float32) + 1.0
    )


def test_a_buffer_left_uninitialised_is_refused_in_one_line() -> None:
    with pytest.raises(SpecError, match=r"layers\.0.*'scale'.*init_weights"):
        build_stage(PipelineSpec.from_layers([FromWeight]), [0], seed=0, device="cpu")


# ----------------------------------------------------------------- trap 3: loss reduction
def mean_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def smoothed(reduction: str) -> Any:
    """A label-smoothed cross-entropy: no value tells its mean from its sum."""

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        flat = logits.reshape(-1, logits.shape[-1])
        return F.cross_entropy(flat, targets.reshape(-1), label_smoothing=0.1, reduction=reduction)

    return loss


@pytest.mark.parametrize(
    ("mean_loss", "sum_loss"),
    [(mean_ce, None), (smoothed("mean"), smoothed("sum"))],
    ids=["cross-entropy", "label-smoothed"],
)
def test_a_mean_loss_declared_mean_gives_the_full_batch_gradients(
    mean_loss: Any, sum_loss: Any
) -> None:
    spec = user_spec()
    inputs, targets, positions = batch()
    targets = targets.clone()
    targets[0, :4] = -100  # micro-batches with different token counts
    extras = {"positions": positions}
    summed = {"loss_fn": sum_loss, "loss_reduction": "sum" if sum_loss else None}
    reference = pipe_of(spec, **summed)
    want = reference.step(inputs, targets, extras=extras)
    pipe = pipe_of(spec, loss_fn=mean_loss, loss_reduction="mean")
    got = pipe.step(inputs, targets, extras=extras)
    assert got.loss == pytest.approx(want.loss, rel=1e-6)
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref[name].grad, rtol=1e-5, atol=1e-7)


def test_a_loss_fn_without_a_declared_reduction_is_refused_when_built() -> None:
    # A label-smoothed mean was taken for a sum: loss and gradients silently 1/targets.
    with pytest.raises(
        PipelineInputError,
        match=r"^loss_fn is given without loss_reduction: pass loss_reduction='sum' .* or "
        r"loss_reduction='mean' ",
    ) as info:
        pipe_of(user_spec(), loss_fn=smoothed("mean"))
    assert "\n" not in str(info.value)


def test_a_mean_loss_declared_sum_is_refused() -> None:
    inputs, targets, positions = batch()
    pipe = pipe_of(user_spec(), loss_fn=mean_ce, loss_reduction="sum")
    with pytest.raises(PipelineInputError, match=r"mean.*loss_reduction='mean'"):
        pipe.step(inputs, targets, extras={"positions": positions})


def test_loss_reduction_takes_sum_or_mean() -> None:
    with pytest.raises(PipelineInputError, match=r"loss_reduction='avg'"):
        pipe_of(user_spec(), loss_fn=mean_ce, loss_reduction="avg")


# ----------------------------------------------------------------- trap 4: top-level names
def test_top_level_layers_keep_their_own_parameter_names() -> None:
    pipe = pipe_of(user_spec())
    names = {name for name, _ in pipe.named_parameters()}
    assert {"tok_embeddings.weight", "norm.weight", "output.weight"} <= names
    assert "layers.2.wq.weight" in names


def test_top_level_names_that_clash_are_refused() -> None:
    spec = PipelineSpec.from_layers([LayerSpec("", "block", Head), LayerSpec("", "block", Head)])
    with pytest.raises(SpecError, match=r"'norm'"):
        pipe_of(spec, schedule="gpipe", ranks=2)


# ----------------------------------------------------------------- trap 5: state dicts
def test_state_dict_round_trips_by_global_name() -> None:
    spec = user_spec()
    inputs, targets, positions = batch()
    source = pipe_of(spec, seed=1)
    state = source.state_dict()
    full = build_full_model(spec, seed=1, device="cpu").state_dict()
    assert state.keys() == full.keys()
    for name, tensor in full.items():
        torch.testing.assert_close(state[name], tensor)
    target = pipe_of(spec, seed=2, schedule="gpipe")
    target.load_state_dict(state)
    extras = {"positions": positions}
    assert target.eval_loss(inputs, targets, extras=extras) == pytest.approx(
        source.eval_loss(inputs, targets, extras=extras), rel=1e-6
    )


def test_load_state_dict_names_missing_and_unexpected_keys() -> None:
    pipe = pipe_of(user_spec())
    state = pipe.state_dict()
    del state["norm.weight"]
    with pytest.raises(PipelineInputError, match=r"missing.*'norm.weight'"):
        pipe.load_state_dict(state)
    pipe.load_state_dict(state, strict=False)
    state = {**pipe.state_dict(), "layers.9.wq.weight": torch.zeros(C, C)}
    with pytest.raises(PipelineInputError, match=r"unexpected.*'layers.9.wq.weight'"):
        pipe.load_state_dict(state)
