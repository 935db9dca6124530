"""The loop's side of checkpoints in one process: when saves happen, resume, the stop
signal (SIGTERM finishes the step, saves, stops; a second SIGINT interrupts), policy errors,
and what resume does with this run's settings: a checkpoint past the run's steps is one
line, settings that change the run from here are named, this run's optimizer settings are
kept with the saved state."""

from __future__ import annotations

import gc
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipetrain.checkpoint import (
    CheckpointError,
    Layout,
    list_checkpoints,
    read_manifest,
    save_checkpoint,
    trainer,
)
from pipetrain.checkpoint.trainer import CheckpointPolicy, RunCheckpoints, StopSignal

MODEL = {"family": "toy", "d_model": 4}


def _run(
    tmp_path: Path, policy: CheckpointPolicy, total: int = 5
) -> tuple[RunCheckpoints, nn.Linear, list[str]]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    said: list[str] = []
    run = RunCheckpoints(
        policy,
        modules=[model],
        optimizer=opt,
        model={"d": 3},
        layout=Layout(pp=1),
        config={"run": {"steps": total}},
        total_steps=total,
        group=None,
        device=torch.device("cpu"),
        say=said.append,
        state=lambda step: {"data_position": step * 2},
    )
    return run, model, said


def _step(model: nn.Linear, run: RunCheckpoints) -> None:
    model.weight.grad = torch.ones_like(model.weight)
    model.bias.grad = torch.ones_like(model.bias)
    run._optimizer.step()


def test_saves_every_k_steps_and_at_the_end_keeping_n(tmp_path: Path) -> None:
    policy = CheckpointPolicy(str(tmp_path), every=2, keep=2)
    run, model, _ = _run(tmp_path, policy, total=5)
    try:
        for step in range(1, 6):
            _step(model, run)
            assert run.after_step(step) is False
    finally:
        run.close()
    assert [s for s, _ in list_checkpoints(tmp_path).complete] == [4, 5]
    manifest = read_manifest(tmp_path / "step_000005")
    assert manifest.trainer == {"data_position": 10}
    assert manifest.config == {"run": {"steps": 5}}


def test_resume_starts_from_the_newest_checkpoint_with_its_weights(tmp_path: Path) -> None:
    run, model, _ = _run(tmp_path, CheckpointPolicy(str(tmp_path), every=3))
    for step in range(1, 4):
        _step(model, run)
        run.after_step(step)
    run.close()
    expected = model.weight.detach().clone()
    again, other, said = _run(tmp_path, CheckpointPolicy(str(tmp_path), every=3, resume=True))
    assert not torch.equal(other.weight, expected)
    assert again.resume() == 3
    again.close()
    assert torch.equal(other.weight, expected)
    assert any("resumed from" in line and "at step 3" in line for line in said)
    fresh, _, _ = _run(tmp_path / "empty", CheckpointPolicy(str(tmp_path / "empty"), resume=True))
    assert fresh.resume() == 0
    fresh.close()


def test_sigterm_finishes_the_step_saves_and_stops(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    run, model, _ = _run(tmp_path, CheckpointPolicy(str(tmp_path), every=100), total=50)
    try:
        _step(model, run)
        assert run.after_step(1) is False
        os.kill(os.getpid(), signal.SIGTERM)  # lands mid-step: only a flag is set
        _step(model, run)
        assert run.after_step(2) is True
    finally:
        run.close()
    assert run.stopped
    assert [s for s, _ in list_checkpoints(tmp_path).complete] == [2]
    assert signal.getsignal(signal.SIGTERM) is before


class _Clock:
    """``time.monotonic`` for the trainer's handler, moved on by hand: how far apart two
    signals are does not depend on how busy the machine is."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_second_sigint_interrupts_at_once_and_close_restores_handlers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = _Clock()
    monkeypatch.setattr(trainer, "time", clock)
    before = signal.getsignal(signal.SIGINT)
    stop = StopSignal()
    os.kill(os.getpid(), signal.SIGINT)
    clock.now += 0.9
    os.kill(os.getpid(), signal.SIGINT)  # the same Ctrl-C, forwarded by a launcher
    assert stop.local
    clock.now += 0.2
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
    stop.close()
    assert signal.getsignal(signal.SIGINT) is before


def test_a_stop_learned_from_another_rank_is_not_this_ranks_first_ctrl_c(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Another node's rank was signalled first: this rank learns the stop in the agreement
    # and is saving when its own Ctrl-C comes, seconds later. That is its first: it must
    # only set the flag, not interrupt the save as a second Ctrl-C would.
    clock = _Clock()
    monkeypatch.setattr(trainer, "time", clock)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, **_: tensor.fill_(1.0))
    stop = StopSignal()
    try:
        assert stop.agreed(object(), torch.device("cpu")) is True
        clock.now += 5.0
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.local
        clock.now += 5.0
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # asked twice on this rank: now it is
    finally:
        stop.close()


def test_a_signal_during_the_agreement_is_kept_for_the_next_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The launcher signals every rank at once; ranks wait in the agreement's all-reduce,
    # so that is where the signal often lands. Its Python handler runs when the call
    # returns, after the flag was read: this step says no, the next one must say yes.
    def all_reduce_signalled_inside(tensor: torch.Tensor, **_: object) -> None:
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(dist, "all_reduce", all_reduce_signalled_inside)
    stop = StopSignal()
    try:
        assert stop.agreed(object(), torch.device("cpu")) is False
        assert stop.local
        monkeypatch.setattr(dist, "all_reduce", lambda tensor, **_: None)
        assert stop.agreed(object(), torch.device("cpu")) is True
    finally:
        stop.close()


def test_handlers_go_back_when_a_failed_loop_drops_the_object(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    run, _, _ = _run(tmp_path, CheckpointPolicy(str(tmp_path)))
    assert signal.getsignal(signal.SIGTERM) is not before
    del run
    gc.collect()
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"resume": True}, "--resume needs a directory: add --checkpoint-dir DIR"),
        ({"every": 5}, "--checkpoint-every needs a directory"),
        ({"directory": "d", "every": -1}, "checkpoint_every is -1"),
        ({"directory": "d", "keep": -2}, "keep is -2"),
    ],
)
def test_policy_errors_name_the_setting(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        CheckpointPolicy(**kwargs)  # type: ignore[arg-type]


def test_a_checkpoint_past_the_run_steps_is_refused_in_one_line(tmp_path: Path) -> None:
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    save_checkpoint(tmp_path, 5, modules=model, optimizer=optimizer, model=MODEL)

    def run(total: int) -> RunCheckpoints:
        return RunCheckpoints(
            CheckpointPolicy(str(tmp_path), resume=True),
            modules=[model],
            optimizer=optimizer,
            model=MODEL,
            layout=Layout(),
            config={},
            total_steps=total,
            group=None,
            device=torch.device("cpu"),
        )

    short = run(3)
    with pytest.raises(CheckpointError) as raised:
        short.resume()
    short.close()
    assert str(raised.value) == (
        f"{tmp_path / 'step_000005'} is at step 5, past this run's 3 steps: pass --steps 6 "
        "or more to continue it, or another --checkpoint-dir"
    )
    done = run(5)
    assert done.resume() == 5  # a finished run resumed with the same steps: nothing to do
    done.close()


def test_resume_names_the_settings_that_change_the_run_from_here(tmp_path: Path) -> None:
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = {
        "pipeline": {"pp": 2},
        "data": {"batch_size": 4, "seq_len": 16},
        "optim": {"lr": 0.1, "grad_accum": 1},
        "run": {"steps": 5, "seed": 0, "name": "first"},
    }
    save_checkpoint(tmp_path, 2, modules=model, optimizer=optimizer, model=MODEL, config=saved)

    def resume(config: dict[str, dict[str, object]]) -> list[str]:
        said: list[str] = []
        run = RunCheckpoints(
            CheckpointPolicy(str(tmp_path), resume=True),
            modules=[model],
            optimizer=optimizer,
            model=MODEL,
            layout=Layout(),
            config=config,
            total_steps=5,
            group=None,
            device=torch.device("cpu"),
            say=said.append,
        )
        assert run.resume() == 2
        run.close()
        return [line for line in said if line.startswith("note:")]

    # Another layout and another run name change nothing that matters.
    same = {**saved, "pipeline": {"pp": 3}, "run": {**saved["run"], "name": "second"}}
    assert resume(same) == []
    other = {**same, "optim": {"lr": 0.1, "grad_accum": 2}, "run": {**same["run"], "steps": 8}}
    assert resume(other) == [
        "note: resuming with settings other than the saved run's (optim.grad_accum 1 -> 2, "
        "run.steps 5 -> 8): the steps from here are not those of the run continued as it was"
    ]


def test_resume_keeps_this_runs_optimizer_settings_and_loads_the_state(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    saved = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.9, 0.95), weight_decay=0.1)
    model(torch.ones(2, 4)).sum().backward()
    saved.step()
    save_checkpoint(tmp_path, 1, modules=model, optimizer=saved, model=MODEL)
    moments = saved.state[model.weight]["exp_avg"].clone()

    changed = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.5), weight_decay=0.7)
    run = RunCheckpoints(
        CheckpointPolicy(str(tmp_path), resume=True),
        modules=[model],
        optimizer=changed,
        model=MODEL,
        layout=Layout(),
        config={},
        total_steps=3,
        group=None,
        device=torch.device("cpu"),
    )
    assert run.resume() == 1
    run.close()
    (group,) = changed.param_groups
    assert (group["betas"], group["weight_decay"]) == ((0.8, 0.5), 0.7)
    assert torch.equal(changed.state[model.weight]["exp_avg"], moments)
