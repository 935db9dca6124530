"""Sampling text, as a run does after its last step and ``pipetrain generate`` does: a
tiny temperature is near greedy, not a crash, and a seed past 64 bits is refused before
anything runs."""

from __future__ import annotations

import pytest

from pipetrain.config import ConfigError, TrainConfig, load_config


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
