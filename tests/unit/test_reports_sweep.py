"""The trainer's reports and settings of an asynchronous run: the simulated bubble from the
measured times, the timeline path, the stream length."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipetrain.config import ConfigError, TrainConfig, load_config
from pipetrain.runtime.timeline import measured_costs, simulated_bubble
from pipetrain.schedules import Kind
from pipetrain.schedules.execution import Costs
from pipetrain.sim import simulate
from pipetrain.train.pipedream.plan import async_schedule, stream_steps_for
from pipetrain.train.plan import plan_run


@pytest.mark.parametrize("name", ["pipedream", "pipedream-2bw"])
def test_replay_of_an_async_run_keeps_its_optimizer_steps(name: str) -> None:
    # A "measured" run that is exactly the simulator's, with optimizer steps that take time:
    # its replay must give back the same bubble (the steps were once costed at 0).
    schedule = async_schedule(name, 2, 4, 2)
    costs = Costs(forward=(1.0, 1.5), backward=(2.0, 3.0), step=0.75)
    run = simulate(schedule, costs)
    assert any(e.action.kind is Kind.STEP for e in run.timeline.events)
    assert measured_costs(run.timeline, schedule).step == 0.75
    got = simulated_bubble([run.timeline, run.timeline], schedule)
    assert got == pytest.approx(run.bubble.idle_fraction)


def test_no_measured_run_has_no_simulated_bubble() -> None:
    assert simulated_bubble([], async_schedule("pipedream", 2, 2, 1)) is None


def test_a_timeline_path_that_is_a_folder_is_refused_before_training(tmp_path: Path) -> None:
    # It was found only when the picture was drawn, after the last step.
    folder = tmp_path / "step.png"
    folder.mkdir()
    overrides = {"run.out_dir": str(tmp_path / "runs"), "run.timeline": str(folder)}
    with pytest.raises(ConfigError, match=r"run.timeline .* is a folder: name a .png file"):
        load_config(overrides=overrides)


def test_a_timeline_is_a_png_picture_or_a_json_trace(tmp_path: Path) -> None:
    base = {"run.out_dir": str(tmp_path / "runs")}
    for name in ("step.png", "step.json"):
        path = str(tmp_path / name)
        assert load_config(overrides={**base, "run.timeline": path}).run.timeline == path
    with pytest.raises(ConfigError, match=r"must name a .png picture or a .json Chrome/Perfetto"):
        load_config(overrides={**base, "run.timeline": str(tmp_path / "step.txt")})


def _async_config(**overrides: object) -> TrainConfig:
    return load_config(
        overrides={
            "run.name": "t",
            "run.steps": 12,
            "optim.warmup_steps": 1,
            "pipeline.schedule": "pipedream",
            "data.seq_len": 16,
            **overrides,
        }
    )


@pytest.mark.parametrize(
    ("overrides", "stream"),
    [
        ({}, 12),  # the default eval_every (40) is past the end: streams of 4 were cut for it
        ({"run.eval_every": 12}, 12),
        ({"run.checkpoint_every": 20, "run.checkpoint_dir": "c"}, 12),
        ({"run.eval_every": 40, "run.checkpoint_every": 8, "run.checkpoint_dir": "c"}, 4),
    ],
)
def test_periods_past_the_run_do_not_cut_streams(overrides: dict[str, object], stream: int) -> None:
    assert stream_steps_for(_async_config(**overrides)) == stream


def test_stream_steps_are_not_refused_for_an_evaluation_past_the_run() -> None:
    # --steps 12 --stream-steps 3 was refused: "run.eval_every 40 does not fall between
    # streams", for an evaluation the run never makes.
    plan = plan_run(_async_config(**{"pipeline.stream_steps": 3}), vocab_size=256)
    assert plan.schedule.asynchronous
    with pytest.raises(ConfigError, match=r"run\.eval_every 6 does not fall between streams"):
        plan_run(_async_config(**{"pipeline.stream_steps": 4, "run.eval_every": 6}), vocab_size=256)


def test_tied_embeddings_are_refused_before_launch() -> None:
    # Each rank found them after the launch and printed the error, with the launcher's lines.
    config = _async_config(**{"model.name": "gpt2-tiny", "pipeline.pp": 2})
    with pytest.raises(ConfigError, match=r"model\.name gpt2-tiny: its tied embeddings"):
        plan_run(config, vocab_size=256)
    plan_run(_async_config(**{"model.name": "gpt2-tiny", "pipeline.pp": 1}), vocab_size=256)


def test_versions_line_says_where_the_simulator_counts_otherwise() -> None:
    from pipetrain.train.pipedream.loop import versions_line

    # 2BW keeps two versions on the last stage too; the simulator's [2, 1] was printed next
    # to the run's [2, 2] as if one of them were wrong.
    line = versions_line("pipedream-2bw", (2, 2), (2, 1), vertical_sync=False)
    assert line == (
        "weight versions per rank: at most [2, 2] alive at once (simulator, whose forwards "
        "take the newest version, not the previous window's: [2, 1])"
    )
    assert versions_line("pipedream", (2, 1), (2, 1), vertical_sync=False).endswith(
        "(simulator: [2, 1])"
    )
    assert "which has no vertical sync" in versions_line(
        "pipedream", (2, 2), (2, 1), vertical_sync=True
    )


def test_a_tiny_sample_temperature_is_near_greedy_not_a_crash() -> None:
    # 1e-45 made every logit +-inf and the probabilities NaN: the run's sample, drawn after
    # the last step, ended in a RuntimeError from multinomial.
    from pipetrain.models import build_full_model, get_model_config, model_spec
    from pipetrain.train.sample import generate

    model = build_full_model(model_spec(get_model_config("llama-tiny")), seed=0, device="cpu")
    model.eval()
    prompt = list(b"def ")

    def text(temperature: float) -> list[int]:
        return generate(model, prompt, new_tokens=6, context=16, temperature=temperature, seed=0)

    assert text(1e-45) == text(0.0)
    assert len(text(0.8)) == 6


def test_a_seed_past_64_bits_is_refused_before_anything_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Both were ValueError tracebacks from torch.Generator.manual_seed: generate at once,
    # train at the sample after its last step.
    from pipetrain.cli import main

    with pytest.raises(ConfigError, match=r"run\.seed is 18446744073709551616: use 0 to "):
        _async_config(**{"run.seed": 2**64})
    _async_config(**{"run.seed": 2**64 - 1})
    for seed in (str(2**64), "-1"):
        argv = ["generate", "--checkpoint", "none", "--prompt", "x", "--seed", seed]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err == f"pipetrain generate: error: --seed is {seed}: use 0 to {2**64 - 1}\n"
