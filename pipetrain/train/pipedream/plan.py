"""The settings of an asynchronous run (pipedream, pipedream-2bw), checked before launch.

Torch-free, like ``pipetrain.train.plan`` which calls it, so a bad combination is one line
before any process starts.
"""

from __future__ import annotations

import math

from pipetrain.config.schema import ConfigError, TrainConfig
from pipetrain.errors import InputError
from pipetrain.models.config import PRESETS
from pipetrain.schedules import Schedule
from pipetrain.schedules.pipedream import pipedream, pipedream_2bw

__all__ = ["ASYNC_SCHEDULES", "async_schedule", "check_async", "stream_steps_for"]

ASYNC_SCHEDULES = ("pipedream", "pipedream-2bw")


def async_schedule(name: str, pp: int, microbatches: int, steps: int) -> Schedule:
    """The stream of ``steps`` windows of ``microbatches`` for ``name`` (pipedream, -2bw)."""
    if name not in ASYNC_SCHEDULES:
        raise ConfigError(
            f"schedule {name!r} is not asynchronous: use {' or '.join(ASYNC_SCHEDULES)}"
        )
    build = pipedream_2bw if name == "pipedream-2bw" else pipedream
    return build(pp, microbatches, steps)


def _periods(config: TrainConfig) -> tuple[tuple[str, int], ...]:
    """The evaluation and save periods that fall inside the run (0: none).

    A period of the run's length or more acts only at the end, where the last stream ends
    anyway: the default eval_every of 40 shortened a 12-step run's streams to 4 steps (a
    drain each) and refused --stream-steps 3 for it.
    """
    r = config.run
    evals = r.eval_every if r.evaluate else 0
    return tuple(
        (name, every if every < r.steps else 0)
        for name, every in (("run.eval_every", evals), ("run.checkpoint_every", r.checkpoint_every))
    )


def stream_steps_for(config: TrainConfig) -> int:
    """Training steps per stream: the setting, or the longest that evaluation and
    checkpoints allow (every evaluation and save falls between two streams)."""
    if config.pipeline.stream_steps:
        return config.pipeline.stream_steps
    steps = config.run.steps
    for _, every in _periods(config):
        if every:
            steps = math.gcd(steps, every)
    return steps


def check_async(config: TrainConfig, *, asynchronous: bool, tied_embeddings: bool = False) -> None:
    """Raise ``ConfigError`` for settings an asynchronous run (or a synchronous one) cannot use.

    ``tied_embeddings``: the model's LM head reuses its token embedding.
    """
    p, r = config.pipeline, config.run
    if not asynchronous:
        if p.vertical_sync:
            raise ConfigError(
                f"pipeline.vertical_sync is for --schedule pipedream, not {p.schedule}: "
                f"drop --vertical-sync"
            )
        if p.stream_steps:
            raise ConfigError(
                f"pipeline.stream_steps is for asynchronous schedules (pipedream, "
                f"pipedream-2bw), not {p.schedule}: drop --stream-steps"
            )
        return
    if p.vertical_sync and p.schedule != "pipedream":
        raise ConfigError(
            f"pipeline.vertical_sync is for pipedream: {p.schedule} already gives every stage "
            f"of a micro-batch the same version; drop --vertical-sync"
        )
    _check_unsupported(config)
    if p.chunks > 1:
        raise ConfigError(f"pipeline.chunks {p.chunks}: {p.schedule} has one stage per rank")
    if tied_embeddings and p.pp > 1:
        # Found by every rank after the launch otherwise, each printing it.
        raise ConfigError(
            f"model.name {config.model.name}: its tied embeddings would live on two stages, "
            f"which {p.schedule} updates on their own (the copies would drift apart): use a "
            f"model without tied embeddings (e.g. llama-tiny) or a synchronous schedule"
        )
    if p.stream_steps and r.steps % p.stream_steps:
        raise ConfigError(
            f"run.steps {r.steps} is not a multiple of pipeline.stream_steps {p.stream_steps}: "
            f"use --steps {r.steps - r.steps % p.stream_steps or p.stream_steps} or another "
            f"--stream-steps"
        )
    stream = stream_steps_for(config)
    for name, every in _periods(config):
        if every and every % stream:
            raise ConfigError(
                f"{name} {every} does not fall between streams of pipeline.stream_steps "
                f"{stream}: use a multiple of {stream}, or --stream-steps 0"
            )
    try:
        async_schedule(p.schedule, p.pp, p.microbatches, stream)
    except InputError as exc:
        raise ConfigError(f"pipeline: {exc} (a stream is {stream} steps)") from None


def _check_unsupported(config: TrainConfig) -> None:
    """Options an asynchronous run cannot use, each refused in one line."""
    p, o, r = config.pipeline, config.optim, config.run
    if config.model.init_from:
        raise ConfigError(
            "model.init_from: the asynchronous trainer does not load imported weights yet: "
            "use a synchronous schedule (1f1b, zb-h1, ...) or drop --init-from"
        )
    if PRESETS[config.model.name].n_experts:
        raise ConfigError(
            f"model.name {config.model.name}: the asynchronous trainer does not train "
            f"mixture-of-experts models yet (their loads and balancing are per synchronous "
            f"step): use a synchronous schedule (1f1b, zb-h1, ...)"
        )
    if r.profile:
        raise ConfigError(
            "run.profile: the asynchronous trainer runs a stream of steps as one pass, which "
            "--profile does not record yet: drop --profile or use a synchronous schedule"
        )
    if p.tp > 1:
        raise ConfigError(
            f"pipeline.tp {p.tp}: the asynchronous trainer keeps weight versions of whole "
            f"layers, not of tensor-parallel shards: use --tp 1 or a synchronous schedule"
        )
    if p.dp > 1:
        raise ConfigError(
            f"pipeline.dp {p.dp}: asynchronous schedules update each stage on its own and run "
            f"one pipeline: use --dp 1"
        )
    if r.grad_report:
        raise ConfigError(
            "run.grad_report: an asynchronous schedule updates each stage after every "
            "micro-batch, with no step whose gradients are final: drop --grad-report or use a "
            "synchronous schedule"
        )
    if o.grad_accum > 1:
        raise ConfigError(
            f"optim.grad_accum {o.grad_accum}: an asynchronous schedule updates after every "
            f"micro-batch (pipedream) or window (pipedream-2bw): use --grad-accum 1 and more "
            f"--microbatches"
        )
    for name, value, flag in (
        ("pipeline.recompute", p.recompute, "--recompute"),
        ("pipeline.recompute_ranks", bool(p.recompute_ranks), "--recompute-ranks"),
        ("pipeline.compile", p.compile, "--compile"),
        ("pipeline.precision bf16", p.precision == "bf16", "--precision bf16"),
    ):
        # Each would run a forward, or cache a cast of the weights, outside the version
        # the micro-batch is bound to.
        if value:
            raise ConfigError(
                f"{name} is not supported with asynchronous schedules (weight stashing): drop {flag}"
            )
