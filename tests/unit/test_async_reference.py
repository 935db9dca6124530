"""Asynchronous pipelines in the single-process debug mode against the hand-written reference.

The runtime keeps weight versions by swapping ``p.data`` and packing saved tensors; the
reference (pipetrain.train.pipedream.reference) keeps them as dicts and runs
``functional_call``. Equal losses and weights over several streams mean the stashing, the
2BW double buffer and vertical sync pick the same versions at the same moments.
"""

from __future__ import annotations

import copy

import pytest
import torch

from pipetrain.models import build_full_model, get_model_config, model_spec
from pipetrain.runtime import even_split
from pipetrain.runtime.stage import token_cross_entropy
from pipetrain.train.pipedream.reference import reference_run
from pipetrain.train.pipedream.trainer import AsyncTrainer, predicted_versions

# Powers of two throughout (32 tokens a micro-batch, 512 a stream): rescaling a gradient
# from the stream's token count to its update's is exact, so the two sides can agree to
# rounding of the same operations.
STREAM_STEPS, STREAMS, WINDOW, BATCH, SEQ = 4, 2, 4, 8, 16


def _spec():  # type: ignore[no-untyped-def]
    return model_spec(get_model_config("llama-tiny", n_layers=4))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def _optimizer(kind: str):  # type: ignore[no-untyped-def]
    def make(params, names=None):  # type: ignore[no-untyped-def]
        params = [p for _, p in params] if names is None else params
        if kind == "sgd":
            return torch.optim.SGD(params, lr=0.2, momentum=0.9)
        return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)

    return make


def _lr(step: int) -> float:
    return 0.05 * (1 + step % 3)


def _train(schedule: str, pp: int, kind: str, vertical: bool):  # type: ignore[no-untyped-def]
    spec = _spec()
    trainer = AsyncTrainer(
        spec,
        schedule=schedule,
        pp=pp,
        microbatches=WINDOW,
        stream_steps=STREAM_STEPS,
        make_optimizer=_optimizer(kind),
        lr_at=_lr if kind == "sgd" else None,
        vertical_sync=vertical,
        device="cpu",
    )
    batches = _batches(STREAM_STEPS * STREAMS)
    losses: list[float] = []
    for s in range(STREAMS):
        chunk = batches[s * STREAM_STEPS : (s + 1) * STREAM_STEPS]
        result = trainer.train_stream(
            s * STREAM_STEPS,
            torch.cat([b[0] for b in chunk]),
            torch.cat([b[1] for b in chunk]),
        )
        losses.extend(result.losses)
    reference = reference_run(
        spec,
        even_split(len(spec), pp),
        schedule=schedule,
        pp=pp,
        microbatches=WINDOW,
        stream_steps=STREAM_STEPS,
        streams=STREAMS,
        batches=batches,
        make_optimizer=_optimizer(kind),
        lr_at=_lr if kind == "sgd" else None,
        vertical_sync=vertical,
    )
    return trainer, losses, reference


CASES = [
    ("pipedream", 2, "sgd", False),
    ("pipedream", 4, "sgd", False),
    ("pipedream", 4, "sgd", True),
    ("pipedream-2bw", 2, "sgd", False),
    ("pipedream-2bw", 4, "sgd", False),
    ("pipedream", 4, "adamw", False),
    ("pipedream-2bw", 4, "adamw", False),
]


@pytest.mark.parametrize(("schedule", "pp", "kind", "vertical"), CASES)
def test_runtime_equals_reference(schedule: str, pp: int, kind: str, vertical: bool) -> None:
    trainer, losses, reference = _train(schedule, pp, kind, vertical)
    assert len(losses) == STREAM_STEPS * STREAMS
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(reference.losses), rtol=1e-5, atol=0
    )
    names = dict(trainer.pipeline.named_parameters())
    assert set(names) == set(reference.weights)
    for name, param in names.items():
        torch.testing.assert_close(param.detach(), reference.weights[name], rtol=1e-5, atol=1e-7)
    # Every stage made a version per backward (PipeDream) or per window (2BW).
    per_step = WINDOW if schedule == "pipedream" else 1
    assert [s.created for s in trainer.version_stats()] == [STREAM_STEPS * STREAMS * per_step] * pp
    # Live versions: p - r on rank r for PipeDream, 2 for 2BW, as the simulator predicts.
    peaks = trainer.rank_peaks()
    predicted = predicted_versions(schedule, pp, WINDOW, STREAM_STEPS)
    if schedule == "pipedream-2bw":
        # Two buffers on every stage. The simulator lets a forward take the newest version,
        # so it sees one on the last stage, where the W(t-1) rule still keeps two.
        assert peaks == (2,) * pp and max(predicted) == 2
    elif not vertical:
        assert peaks == predicted == tuple(pp - r for r in range(pp))
    else:
        # Vertical sync: a later stage also keeps the older versions the first stage chose.
        assert peaks[0] == pp and all(peak >= pp - r for r, peak in enumerate(peaks))
    # Between streams nothing is in flight: one version per stage, the parameters.
    assert set(trainer.versions.live().values()) == {1}


@pytest.mark.parametrize("schedule", ["pipedream", "pipedream-2bw"])
def test_drained_state_is_enough_to_resume(schedule: str) -> None:
    """Weights, optimizer state and the step after a stream continue the run exactly."""

    def build() -> AsyncTrainer:
        return AsyncTrainer(
            _spec(),
            schedule=schedule,
            pp=2,
            microbatches=WINDOW,
            stream_steps=STREAM_STEPS,
            make_optimizer=_optimizer("adamw"),
            device="cpu",
        )

    def run(trainer: AsyncTrainer, stream: int) -> tuple[float, ...]:
        chunk = batches[stream * STREAM_STEPS : (stream + 1) * STREAM_STEPS]
        inputs = torch.cat([b[0] for b in chunk])
        targets = torch.cat([b[1] for b in chunk])
        return trainer.train_stream(stream * STREAM_STEPS, inputs, targets).losses

    batches = _batches(STREAM_STEPS * 2)
    whole = build()
    run(whole, 0)
    saved = {
        "model": [m.state_dict() for m in whole.pipeline.modules],
        "optim": copy.deepcopy(whole.optimizer.state_dict()),
    }
    uninterrupted = run(whole, 1)
    resumed = build()
    for module, state in zip(resumed.pipeline.modules, saved["model"], strict=True):
        module.load_state_dict(state)
    resumed.optimizer.load_state_dict(saved["optim"])
    assert run(resumed, 1) == uninterrupted
    for (name, a), (_, b) in zip(
        whole.pipeline.named_parameters(), resumed.pipeline.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name


def test_eval_counts_every_batch_once() -> None:
    """4 batches through streams of 3: the filler batches of the second group do not count."""
    spec = _spec()
    trainer = AsyncTrainer(
        spec,
        schedule="pipedream-2bw",
        pp=2,
        microbatches=WINDOW,
        stream_steps=3,
        make_optimizer=_optimizer("sgd"),
        device="cpu",
    )
    batches = _batches(4)
    model = build_full_model(spec, seed=0, device="cpu")
    with torch.no_grad():
        want = sum(float(token_cross_entropy(model(x), y)) / y.numel() for x, y in batches) / len(
            batches
        )
    got = trainer.eval_loss([(x, y) for x, y in batches])
    assert got == pytest.approx(want, rel=1e-6)


def test_a_stream_names_its_training_steps_in_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipeline counts its own passes (1 again after a resume); errors name the run's steps."""
    trainer = AsyncTrainer(
        _spec(),
        schedule="pipedream",
        pp=2,
        microbatches=WINDOW,
        stream_steps=STREAM_STEPS,
        make_optimizer=_optimizer("sgd"),
        device="cpu",
    )
    labels: list[str | None] = []
    step = trainer.pipeline.step

    def recording(*args, label=None, **kwargs):  # type: ignore[no-untyped-def]
        labels.append(label)
        return step(*args, label=label, **kwargs)

    monkeypatch.setattr(trainer.pipeline, "step", recording)
    chunk = _batches(STREAM_STEPS)
    first = 3 * STREAM_STEPS  # a resumed run's fourth stream
    trainer.train_stream(first, torch.cat([b[0] for b in chunk]), torch.cat([b[1] for b in chunk]))
    assert labels == [f"the stream of training steps {first + 1}-{first + STREAM_STEPS}"]
