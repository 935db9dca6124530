"""The runtime's Python API (``build_pipeline``, ``Pipeline.step``) as a user's own loop
meets it: wrong calls, a step that fails part-way, and user layers with mixed boundaries,
all in the single-process debug mode.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipetrain.models import (
    LayerSpec,
    PipelineSpec,
    SpecError,
    TiedWeight,
    build_full_model,
    get_model_config,
    model_spec,
)
from pipetrain.runtime import (
    PipelineHooks,
    PipelineInputError,
    StageMismatchError,
    build_pipeline,
)
from pipetrain.schedules import Kind
from pipetrain.train.pipedream.weights import WeightVersions

VOCAB = 11


class _Embed(nn.Module):
    """Token ids in; the hidden state and an int64 position tensor out (no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, 6)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tok(ids), torch.arange(ids.shape[1]).expand_as(ids)  # (B, T, C), (B, T)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, h: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = (pos.unsqueeze(-1).float() + 1).log1p()  # (B, T, 1)
        return h + torch.tanh(self.lin(h)) * scale, pos


class _Halve(nn.Module):
    """A layer without parameters."""

    def forward(self, h: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return h * 0.5, pos


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(6, VOCAB)

    def forward(self, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.out(h)  # (B, T, V)


class _DictHead(_Head):
    def forward(self, h: torch.Tensor, pos: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {"logits": self.out(h)}


LAYERS = [_Embed, _Block, _Halve, _Block, _Head]


def batch(seed: int = 0, b: int = 8, t: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, t + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def pipeline(**kwargs):
    options = {"schedule": "1f1b", "ranks": 2, "microbatches": 4, "device": "cpu", "seed": 0}
    options.update(kwargs)
    return build_pipeline(options.pop("layers", LAYERS), **options)


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1", "zb-v"])
def test_user_layers_with_int_boundary_and_no_parameters_equal_one_process(schedule):
    x, y = batch()
    full = build_full_model(PipelineSpec.from_layers(LAYERS), seed=0, device="cpu")
    logits = full(x)
    ref = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
    ref.backward()
    pipe = pipeline(schedule=schedule)
    assert pipe.step(x, y).loss == pytest.approx(ref.item(), rel=1e-5)
    grads = {n: p.grad for n, p in full.named_parameters()}
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-7)


def test_a_step_that_fails_part_way_is_refused_until_zeroed_then_runs_clean():
    x, y = batch()
    bad = x.clone()
    bad[-1, 0] = VOCAB  # out of the embedding: the first stage fails on the last micro-batch
    pipe = pipeline()
    with pytest.raises(IndexError):
        pipe.step(bad, y)
    # Micro-batches 0 and 1 went backward before the failure: their gradients are in .grad.
    with pytest.raises(PipelineInputError, match=r"training step 1 failed part-way.*zero_grad"):
        pipe.step(x, y)
    for p in pipe.parameters():
        if p.grad is not None:
            p.grad.zero_()  # an optimizer's zero_grad(set_to_none=False) will do
    # The failed step's unreceived activations must not stand in for this step's.
    result = pipe.step(x, y)
    fresh = pipeline()
    assert result.loss == fresh.step(x, y).loss
    for (name, p), q in zip(pipe.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_misused_targets_and_losses_are_one_line_input_errors():
    x, y = batch()
    pipe = pipeline()

    def ce_none(logits, targets):
        return nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none"
        )

    cases = [
        (lambda: pipe.step(x, y.float()), r"targets are float32, but the default loss"),
        (lambda: pipe.step(x, y[:, :-1]), r"output \(2, 5, 11\) float32 and targets \(2, 4\)"),
        (lambda: pipe.step(x, y + VOCAB), r"out of bounds"),
        (lambda: pipe.eval_loss(x, y.int()), r"targets are int32, .* pass targets as torch.long"),
        (lambda: pipe.step(x, y[:4]), r"inputs hold 8 sequences but targets 4"),
        (lambda: pipe.step(x[:, :0], y[:, :0]), r"targets of shape \(8, 0\) are empty"),
        (lambda: pipe.step(x.tolist(), y), r"inputs is a list: pass a tensor"),
        (lambda: pipe.step(x, y, denominator=float("inf")), r"positive, finite"),
        (lambda: pipe.step(x, y, denominator="40"), r"positive, finite"),
        (
            lambda: pipeline(loss_fn=ce_none, loss_reduction="sum").step(x, y),
            r"value \(10,\) float32.*0-d tensor",
        ),
        (
            lambda: pipeline(loss_fn=lambda o, t: 1.0, loss_reduction="sum").step(x, y),
            r"value of type float",
        ),
        (
            lambda: pipeline(
                loss_fn=lambda o, t: ce_none(o, t).sum().detach(), loss_reduction="sum"
            ).step(x, y),
            r"without a gradient",
        ),
        (
            lambda: pipeline(layers=[*LAYERS[:-1], _DictHead]).step(x, y),
            r"last layer returned a dict: return the logits as a tensor",
        ),
    ]
    for call, message in cases:
        with pytest.raises(PipelineInputError, match=message) as info:
            call()
        assert "\n" not in str(info.value)
    # Every failure came before a backward: the pipeline goes on as if they never happened.
    assert pipe.step(x, y).loss == pipeline().step(x, y).loss
    # A count of tokens may come as a tensor.
    pipe.zero_grad()
    assert pipe.step(x, y, denominator=torch.tensor(20)).loss == pytest.approx(
        pipeline().step(x, y).loss * 2, rel=1e-6
    )


def test_built_modules_instead_of_factories_are_named():
    with pytest.raises(PipelineInputError, match=r"layer 0 \('layers.0'\) is a built Linear"):
        pipeline(layers=[nn.Linear(6, 6), nn.Linear(6, 6)], schedule="gpipe", ranks=1)
    with pytest.raises(PipelineInputError, match=r"not a factory"):
        pipeline(layers=PipelineSpec.from_layers([_Embed, _Head()]), schedule="gpipe", ranks=1)


def test_token_ids_the_embedding_cannot_look_up_are_named():
    tiny = model_spec(get_model_config("llama-tiny", n_layers=1))
    user = [LayerSpec("embed", "embedding", _Embed), *LAYERS[1:]]
    x, y = batch()
    for model, vocab in ((tiny, 256), (user, VOCAB)):
        pipe = pipeline(layers=model, schedule="gpipe")
        for ids, message in (
            (x + vocab, rf"token id {vocab + x.max()}, outside the embedding's 0..{vocab - 1}"),
            (x - VOCAB, rf"token id {(x - VOCAB).min()}, outside"),
            (x.float(), r"inputs are float32, but the first layer looks up token ids"),
        ):
            with pytest.raises(PipelineInputError, match=message):
                pipe.step(ids, y)
        assert pipe.step(x, y).tokens == y.numel()


class _MaybeMask(_Block):
    """Returns None in place of a tensor, as a layer with an optional output might."""

    def forward(self, h: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return self.lin(h), None


def test_a_boundary_that_is_not_all_tensors_is_named():
    x, y = batch()
    pipe = pipeline(layers=[_Embed, _MaybeMask, _Head], schedule="gpipe", ranks=3)
    for call in (lambda: pipe.step(x, y), lambda: pipe.eval_loss(x, y)):
        with pytest.raises(StageMismatchError, match=r"stage 1 returned a NoneType for the next"):
            call()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"microbatches": 4.0}, r"microbatches=4.0: pass an int"),
        ({"microbatches": "4"}, r"microbatches='4': pass an int"),
        ({"seed": "a"}, r"seed='a': pass an int"),
        ({"ranks": True}, r"ranks=True: pass an int"),
        ({"device": "gpu"}, r"device='gpu' is not a device torch knows"),
        ({"dtype": torch.int64}, r"dtype=torch.int64: parameters need a floating-point dtype"),
        ({"split": "3,2"}, r"split='3,2': pass one list of layer indices per model stage"),
        ({"timeout_s": "5"}, r"timeout_s='5': use a positive number"),
    ],
)
def test_build_arguments_of_the_wrong_kind_are_named(options, message):
    with pytest.raises(PipelineInputError, match=message):
        pipeline(**options)


def test_chunks_beside_a_loaded_schedule_must_be_its_own():
    from pipetrain.schedules.registry import build_schedule

    loaded = build_schedule("1f1b", 2, 4)  # as load_csv would give it: a Schedule
    with pytest.raises(
        PipelineInputError,
        match=r"chunks=2, but schedule '1f1b' has 1 stage per rank: drop chunks=",
    ):
        pipeline(schedule=loaded, chunks=2)
    assert pipeline(schedule=loaded, chunks=1).schedule.placement.num_stages == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_device_without_cuda_is_named():
    with pytest.raises(PipelineInputError, match=r"device='cuda' but this machine has no CUDA"):
        pipeline(device="cuda")


def test_an_asynchronous_step_outside_its_stream_is_refused_before_any_update():
    holder: dict[str, WeightVersions] = {}
    pipe = build_pipeline(
        model_spec(get_model_config("llama-tiny", n_layers=2)),
        schedule="pipedream",
        ranks=2,
        microbatches=4,
        device="cpu",
        hooks=PipelineHooks(
            step_hook=lambda stage, k: holder["v"].step_hook(stage, k),
            compute_hook=lambda action: holder["v"].compute_hook(action),
        ),
    )
    modules = dict(zip(pipe.stages, pipe.modules, strict=True))
    optimizers = {s: torch.optim.SGD(m.parameters(), lr=0.1) for s, m in modules.items()}
    holder["v"] = versions = WeightVersions(pipe.schedule, modules, optimizers, rule="latest")
    before = [p.detach().clone() for p in pipe.parameters()]
    # A step of pipedream built for 4 micro-batches streams 2 optimizer steps of 4.
    with pytest.raises(PipelineInputError, match=r"multiple of microbatches=8 \(schedule "):
        pipe.step(*batch(b=4))
    x, y = batch(b=8)
    # Without the stream, autograd failed on weights that earlier STEPs had updated in place.
    with pytest.raises(PipelineInputError, match=r"1B0 of a training step ran outside"):
        pipe.step(x, y)
    assert all(torch.equal(p, q) for p, q in zip(pipe.parameters(), before, strict=True))
    with versions.stream():
        pipe.step(x, y)
    steps = [a for row in pipe.schedule.actions for a in row if a.kind is Kind.STEP]
    assert {s.stage: s.created for s in versions.stats()} == {
        stage: sum(1 for a in steps if a.stage == stage) for stage in pipe.stages
    }


class _Many(nn.Module):
    """Nine tensors to the next stage: one more than a message's header describes."""

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(ids.float().unsqueeze(-1) * i for i in range(9))


class _Sum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(1, VOCAB)

    def forward(self, *parts: torch.Tensor) -> torch.Tensor:
        return self.out(sum(parts))


def test_the_debug_mode_refuses_a_boundary_that_processes_cannot_send():
    pipe = pipeline(layers=[_Many, _Sum], schedule="gpipe")
    with pytest.raises(StageMismatchError, match=r"stage 0 sends 9 tensors to stage 1: at most 8"):
        pipe.step(*batch())


class _TransposedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(VOCAB, 6, bias=False)  # (6, V): the embedding's transpose

    def forward(self, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return h @ self.out.weight


@pytest.mark.parametrize("ranks", [1, 2])
def test_tied_parameters_of_different_shapes_are_named(ranks):
    spec = PipelineSpec.from_layers(
        [*LAYERS[:-1], _TransposedHead],
        tied=[TiedWeight("layers.0.tok.weight", 0, "tok.weight", 4, "out.weight")],
    )
    with pytest.raises(SpecError, match=r"layers.0.tok.weight is \(11, 6\) but layers.4.out"):
        pipeline(layers=spec, ranks=ranks)


def test_a_group_that_does_not_fit_this_process_is_named():
    # A one-process gloo world in this process: enough to build against a real group.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(PipelineInputError, match=r"global rank 0\) is not a member"):
            pipeline(ranks=None, group=dist.GroupMember.NON_GROUP_MEMBER)
        with pytest.raises(PipelineInputError, match=r"ranks=2 but the group has 1 ranks"):
            pipeline(group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()
