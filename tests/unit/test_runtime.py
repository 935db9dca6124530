"""The runtime in the single-process debug mode: every schedule equals one process.

The debug mode runs the same executor, stage runner and reductions as the multi-process
runtime, with an in-memory transport, so these tests cover the arithmetic of every
schedule cheaply; tests/dist/ checks that processes give the same bits.
"""

from __future__ import annotations

import pytest
import torch

from pipetrain.models import build_full_model, get_model_config, model_spec
from pipetrain.runtime import (
    PipelineError,
    PipelineHooks,
    PipelineInputError,
    build_pipeline,
    even_split,
)
from pipetrain.runtime.stage import token_cross_entropy
from pipetrain.schedules import Action, Kind, Placement, Schedule
from pipetrain.schedules.io import load_csv
from pipetrain.schedules.registry import build_schedule

RTOL = 1e-5


# (name, ranks, micro-batches): every synchronous schedule, built by name by the registry.
SCHEDULES = [
    ("naive", 2, 4),
    ("gpipe", 2, 4),
    ("1f1b", 2, 4),
    ("interleaved-1f1b", 2, 4),
    ("looped-bfs", 2, 4),
    ("zb-h1", 2, 4),
    ("zb-h2", 2, 4),
    ("zb-v", 2, 4),
    ("dualpipe-v", 2, 4),
    ("v-half", 2, 4),
    ("v-min", 2, 4),
    ("chimera", 2, 4),
    ("naive", 4, 4),
    ("gpipe", 4, 4),
    ("1f1b", 4, 4),
    ("interleaved-1f1b", 4, 4),
    ("looped-bfs", 4, 4),
    ("zb-h1", 4, 4),
    ("zb-h2", 4, 8),
    ("zb-v", 4, 4),
    ("dualpipe-v", 4, 8),
    ("v-half", 4, 4),
    ("v-min", 4, 4),
    ("chimera", 4, 4),
]

# A user's schedule: 1F1B-like on rank 0, split backward with late W's on rank 1.
USER_CSV = """0F0, 0F1, 0F2, 0B0, 0F3, 0B1, 0B2, 0B3
1F0, 1I0, 1F1, 1I1, 1W0, 1F2, 1I2, 1W1, 1F3, 1I3, 1W3, 1W2
"""


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # The machine is shared: one thread per test process keeps the timings honest.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def batch(seed: int = 0, b: int = 8, t: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (b, t + 1), generator=g)
    targets = ids[:, 1:].clone()
    targets[0, :5] = -100  # padding: the loss is per counted token, not per micro-batch
    return ids[:, :-1], targets


def reference(spec, x, y):
    full = build_full_model(spec, seed=0, device="cpu")
    loss = token_cross_entropy(full(x), y) / (y != -100).sum()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in full.named_parameters()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def tied_spec():
    # 8 layers (embedding, 6 blocks, head) so that 4 ranks x 2 chunks have a layer each.
    return model_spec(get_model_config("llama-tiny", n_layers=6, tie_embeddings=True))


def check_equal(pipe, spec, name) -> None:
    x, y = batch()
    ref_loss, ref_grads = reference(spec, x, y)
    result = pipe.step(x, y)
    assert result.loss == pytest.approx(ref_loss, rel=RTOL)
    assert result.tokens == int((y != -100).sum())
    checked = set()
    for module in pipe.modules:
        for pname, p in module.named_parameters(remove_duplicate=False):
            key = pipe.tied_names.get(pname, pname)
            assert p.grad is not None, pname
            assert rel(p.grad, ref_grads[key]) < RTOL, (name, pname)
            checked.add(key)
    assert checked == set(ref_grads)
    # Every action is timed once, inside the step.
    assert len(result.timeline.events) == sum(len(row) for row in pipe.schedule.actions)
    assert all(0 <= e.start <= e.end <= result.step_time_s for e in result.timeline.events)


@pytest.mark.parametrize(
    ("name", "p", "m"), SCHEDULES, ids=[f"{n}-p{p}-m{m}" for n, p, m in SCHEDULES]
)
def test_debug_mode_equals_one_process(name, p, m, tied_spec):
    pipe = build_pipeline(tied_spec, schedule=name, ranks=p, microbatches=m, seed=0, device="cpu")
    check_equal(pipe, tied_spec, name)


def test_user_csv_schedule(tied_spec, tmp_path):
    path = tmp_path / "mine.csv"
    path.write_text(USER_CSV)
    schedule = load_csv(path)
    pipe = build_pipeline(tied_spec, schedule=schedule, microbatches=4, seed=0, device="cpu")
    assert pipe.schedule.is_lowered and pipe.schedule.splits_backward
    check_equal(pipe, tied_spec, "csv")


def test_untied_model_and_uneven_split():
    spec = model_spec(get_model_config("llama-tiny"))
    x, y = batch(1)
    ref_loss, ref_grads = reference(spec, x, y)
    pipe = build_pipeline(
        spec,
        schedule="zb-h1",
        ranks=2,
        microbatches=4,
        seed=0,
        device="cpu",
        split=[[0], [1, 2, 3, 4, 5]],
    )
    assert pipe.step(x, y).loss == pytest.approx(ref_loss, rel=RTOL)
    for name, p in pipe.named_parameters():
        assert rel(p.grad, ref_grads[name]) < RTOL, name


def test_adamw_steps_follow_one_process(tied_spec):
    x, y = batch(2)
    full = build_full_model(tied_spec, seed=0, device="cpu")
    ref_opt = torch.optim.AdamW(full.parameters(), lr=1e-3)
    pipe = build_pipeline(tied_spec, schedule="1f1b", ranks=2, microbatches=4, seed=0, device="cpu")
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    for step in range(3):
        xs, ys = batch(10 + step)
        ref_loss = token_cross_entropy(full(xs), ys) / (ys != -100).sum()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = pipe.step(xs, ys).loss
        opt.step()
        pipe.zero_grad()
        assert loss == pytest.approx(ref_loss.item(), rel=RTOL)
    ref_params = dict(full.named_parameters())
    for name, p in pipe.named_parameters():
        # AdamW divides by sqrt(v): parameters agree to a few 1e-6 when gradients agree to 1e-7.
        torch.testing.assert_close(
            p, ref_params[pipe.tied_names.get(name, name)], rtol=0, atol=2e-5
        )
    assert pipe.eval_loss(x, y) == pytest.approx(
        (token_cross_entropy(full(x), y) / (y != -100).sum()).item(), rel=RTOL
    )


def test_sequence_length_changes_between_steps(tied_spec):
    pipe = build_pipeline(
        tied_spec, schedule="interleaved-1f1b", ranks=2, microbatches=4, seed=0, device="cpu"
    )
    for t in (16, 9, 24):
        x, y = batch(3, t=t)
        pipe.zero_grad()
        ref_loss, ref_grads = reference(tied_spec, x, y)
        assert pipe.step(x, y).loss == pytest.approx(ref_loss, rel=RTOL)
        for name, p in pipe.named_parameters():
            assert rel(p.grad, ref_grads[pipe.tied_names.get(name, name)]) < RTOL


class _Pair(torch.nn.Module):
    """A user layer whose boundary carries two tensors: the hidden state and a mask."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.first = first
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, mask=None):
        if self.first:
            mask = (x.sum(-1, keepdim=True) > 0).float()  # (B, T, 1), no gradient needed
        return torch.tanh(self.lin(x)) * mask + x, mask


class _Last(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 5)

    def forward(self, x, mask):
        return self.lin(x * mask)


def test_several_tensors_per_boundary_and_custom_loss():
    layers = [lambda: _Pair(True), lambda: _Pair(False), lambda: _Pair(False), _Last]
    x = torch.randn(8, 3, 8, generator=torch.Generator().manual_seed(4))
    y = torch.randint(0, 5, (8, 3), generator=torch.Generator().manual_seed(5))

    def loss_fn(logits, targets):
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, 5), targets.reshape(-1), reduction="sum"
        )

    single = build_pipeline(
        layers,
        schedule="naive",
        ranks=1,
        microbatches=1,
        seed=3,
        device="cpu",
        loss_fn=loss_fn,
        loss_reduction="sum",
    )
    ref_loss = single.step(x, y).loss
    ref = {n: p.grad.clone() for n, p in single.named_parameters()}
    pipe = build_pipeline(
        layers,
        schedule="zb-v",
        ranks=2,
        microbatches=4,
        seed=3,
        device="cpu",
        loss_fn=loss_fn,
        loss_reduction="sum",
    )
    assert pipe.step(x, y).loss == pytest.approx(ref_loss, rel=RTOL)
    for name, p in pipe.named_parameters():
        assert rel(p.grad, ref[name]) < RTOL, name


def test_bad_inputs_are_one_line_errors(tied_spec):
    pipe = build_pipeline(
        tied_spec, schedule="gpipe", ranks=2, microbatches=4, seed=0, device="cpu"
    )
    x, y = batch()
    with pytest.raises(PipelineInputError, match="multiple of 4"):
        pipe.step(x[:6], y[:6])
    with pytest.raises(PipelineInputError, match="pass targets"):
        pipe.step(x, None)
    with pytest.raises(PipelineInputError, match="no token"):
        pipe.step(x, torch.full_like(y, -100))
    with pytest.raises(PipelineInputError, match="microbatches=4"):
        build_pipeline(
            tied_spec, schedule=build_schedule("gpipe", 2, 4), microbatches=8, device="cpu"
        )
    with pytest.raises(PipelineInputError, match="ranks="):
        build_pipeline(tied_spec, schedule="gpipe", microbatches=4, device="cpu")
    with pytest.raises(PipelineInputError, match="cover layers"):
        build_pipeline(
            tied_spec,
            schedule="gpipe",
            ranks=2,
            microbatches=4,
            device="cpu",
            split=[[0, 1], [3, 4, 5, 6, 7]],
        )
    with pytest.raises(PipelineInputError, match="n_layers"):
        even_split(3, 4)
    with pytest.raises(PipelineInputError, match="step_hook"):
        rows = [[Action(0, Kind.F, 0), Action(0, Kind.B, 0), Action(0, Kind.STEP, 0)]]
        build_pipeline(
            tied_spec,
            schedule=Schedule.build("async", Placement.linear(1), 1, rows, asynchronous=True),
            microbatches=1,
            device="cpu",
        )


def test_step_hook_runs_for_step_actions(tied_spec):
    rows = [
        [
            Action(0, Kind.F, 0),
            Action(0, Kind.B, 0),
            Action(0, Kind.STEP, 0),
            Action(0, Kind.F, 1),
            Action(0, Kind.B, 1),
            Action(0, Kind.STEP, 1),
        ]
    ]
    calls = []
    pipe = build_pipeline(
        tied_spec,
        schedule=Schedule.build("async", Placement.linear(1), 2, rows, asynchronous=True),
        microbatches=2,
        device="cpu",
        hooks=PipelineHooks(step_hook=lambda stage, mb: calls.append((stage, mb))),
    )
    pipe.step(*batch())
    assert calls == [(0, 0), (0, 1)]


def test_even_split():
    assert even_split(8, 3) == ((0, 1, 2), (3, 4, 5), (6, 7))
    assert even_split(4, 4) == ((0,), (1,), (2,), (3,))


def test_debug_mode_reports_a_deadlock_instead_of_hanging(tied_spec):
    pipe = build_pipeline(
        tied_spec, schedule="gpipe", ranks=2, microbatches=2, seed=0, device="cpu"
    )
    # Rank 1 waits for a micro-batch rank 0 never sends: drop rank 0's second send.
    ex0 = pipe._train[0]
    keep = [i for i, a in enumerate(ex0.actions) if a != Action(0, Kind.SEND_F, 1)]
    ex0.actions = tuple(ex0.actions[i] for i in keep)
    ex0._handlers = tuple(ex0._handlers[i] for i in keep)
    with pytest.raises(PipelineError, match="never comes"):
        pipe.step(*batch())
