"""Everything a run can check before it starts a process: model, schedule, split, device.

``plan_run`` is cheap (no torch, no weights) so that ``pipetrain train --pp 4`` rejects a
bad setting with one line before it launches anything.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipetrain.config.schema import ConfigError, TrainConfig
from pipetrain.errors import InputError
from pipetrain.models.config import ModelConfig, get_model_config
from pipetrain.schedules import Schedule
from pipetrain.schedules.prepare import PreparedSchedule, is_schedule_file, prepare_schedule
from pipetrain.train.microbatch_counts import auto_candidates

__all__ = [
    "RunPlan",
    "block_split",
    "is_schedule_file",
    "plan_fingerprint",
    "plan_run",
    "plans_disagree",
    "threads_per_process",
]


@dataclass(frozen=True)
class RunPlan:
    """The model, schedule and split a config resolves to."""

    model: ModelConfig
    # The schedule, resolved, validated and lowered once for the run (build_pipeline takes
    # it as it is).
    prepared: PreparedSchedule
    # Layer indices of each model stage: blocks spread evenly, the embedding on the first
    # stage and the head on the last.
    split: tuple[tuple[int, ...], ...]
    # pipeline.microbatches_auto: the schedules of the counts the first steps try, the
    # configured one (``prepared``) first (``pipetrain.train.microbatch_counts``).
    candidates: tuple[PreparedSchedule, ...] = ()

    @property
    def schedule(self) -> Schedule:
        """The schedule before lowering (what the simulator replays)."""
        return self.prepared.schedule

    @property
    def early_splits(self) -> tuple[str, ...]:
        """The backwards that early input gradients split (``1I7``; pipeline.early_grads)."""
        return self.prepared.early_splits


def plan_fingerprint(plan: RunPlan) -> dict[str, str]:
    """Short digests of what each process derived from its config: two processes with the
    same settings still differ here when a schedule file holds other actions on another
    node, or another pipetrain version builds another model or split from the same names."""
    s = plan.schedule
    # Not the schedule's name: a loaded file's may carry its path, which nodes may spell
    # differently for the same actions.
    parts = {
        "schedule": (s.placement, s.microbatches, s.actions, s.asynchronous, s.params),
        "split": plan.split,
        # Not the preset's name: a label.
        "model": {k: v for k, v in dataclasses.asdict(plan.model).items() if k != "name"},
    }
    return {k: hashlib.sha256(repr(v).encode()).hexdigest()[:16] for k, v in parts.items()}


def plans_disagree(
    by_rank: Sequence[Mapping[str, str]], schedule_setting: str, model_name: str
) -> str | None:
    """Why processes whose settings agree (``settings_disagree``) derived different
    pipelines (``plan_fingerprint`` of each, by rank), in one line; None when they agree.
    Training on would hang at the first message or mix two models' gradients."""
    first = by_rank[0]
    for rank, theirs in enumerate(by_rank[1:], start=1):
        if theirs["schedule"] != first["schedule"] and is_schedule_file(schedule_setting):
            return (
                f"the schedule file {schedule_setting!r} holds other actions on rank {rank} "
                f"than on rank 0: give every node the same file"
            )
        for part in ("schedule", "split", "model"):
            if theirs[part] != first[part]:
                what = f"model {model_name}" if part == "model" else f"the {part}"
                return (
                    f"{what} comes out differently on rank {rank} than on rank 0 from the "
                    f"same settings: install the same pipetrain version on every node"
                )
    return None


def block_split(n_blocks: int, num_stages: int) -> tuple[tuple[int, ...], ...]:
    """Pipeline layers (embedding 0, blocks 1..n, head n+1) per stage, blocks spread evenly.

    12 blocks on 3 stages: (0..4), (5..8), (9..13): 4 blocks each, not 5, 5, 4 layers.
    """
    base, extra = divmod(n_blocks, num_stages)
    split: list[tuple[int, ...]] = []
    start = 1
    for stage in range(num_stages):
        end = start + base + (1 if stage < extra else 0)
        first = 0 if stage == 0 else start
        last = n_blocks + 2 if stage == num_stages - 1 else end
        split.append(tuple(range(first, last)))
        start = end
    return tuple(split)


def plan_run(config: TrainConfig, *, vocab_size: int, reporter: bool = True) -> RunPlan:
    """Resolve and check model, schedule and split; ``ConfigError`` names what to change.
    ``reporter``: this process writes the run's outputs (rank 0, or a launcher)."""
    if config.model.init_from:
        model = _imported_model(config.model.init_from, vocab_size, config.data.tokenizer)
    else:
        try:
            model = get_model_config(config.model.name, vocab_size=vocab_size)
        except InputError as exc:
            raise ConfigError(f"model.name: {exc}") from None
    model = _moe_settings(config, model)
    if config.data.seq_len > model.max_seq_len:
        raise ConfigError(
            f"data.seq_len {config.data.seq_len} is longer than the {model.max_seq_len} positions of "
            f"model {model.name}: use --seq-len {model.max_seq_len} or less"
        )
    p = config.pipeline
    prepared = _prepare_schedule(config, tied_embeddings=model.tie_embeddings)
    schedule = prepared.schedule
    if p.shard:
        from pipetrain.parallel.sharded import check_shardable

        check_shardable(schedule)
    if p.tp > 1:
        _check_tensor_parallel(config, model)
    stages = schedule.placement.num_model_stages
    # An explicit or balanced split may leave the first stage the embedding alone and the
    # last the head alone (its own checks say what else it refuses); an even split of the
    # blocks needs one per stage.
    uniform = not p.split and p.balance == "uniform"
    if stages > model.n_layers + (0 if uniform else 2):
        raise ConfigError(
            f"schedule {p.schedule!r} on {p.pp} ranks has {stages} model stages but model {model.name} "
            f"has {model.n_layers} blocks: use fewer --pp/--chunks or a model with more blocks"
        )
    candidates = (
        auto_candidates(
            config,
            prepared,
            lambda c: _prepare_schedule(c, tied_embeddings=model.tie_embeddings),
        )
        if p.microbatches_auto
        else ()
    )
    _check_optional_packages(config, reporter)
    if p.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                "pipeline.device is 'cuda' but no CUDA device is available: use --device cpu or auto"
            )
    return RunPlan(model, prepared, _stage_layers(config, model, schedule), candidates)


def _imported_model(directory: str, vocab_size: int, tokenizer: str) -> ModelConfig:
    """model.init_from's config.json as a model, its files checked against it (headers
    only: no weights read), and the tokenizer's ids inside its embedding (``tokenizer``:
    data.tokenizer, "" for bytes)."""
    from pipetrain.models.hf import check_weights, read_hf_config, weight_sources

    try:
        model = read_hf_config(directory).config
        check_weights(directory, weight_sources(model))
    except InputError as exc:
        raise ConfigError(f"model.init_from: {exc}") from None
    if vocab_size > model.vocab_size:
        # Ids past the embedding fail at the first lookup; fewer tokens than rows (a
        # padded embedding) are fine.
        which = f"the tokenizer {tokenizer}" if tokenizer else "the byte tokenizer"
        raise ConfigError(
            f"model.init_from: {which} has {vocab_size} tokens but {directory}'s embedding "
            f"has {model.vocab_size}: use the tokenizer.json the model was trained with (in "
            "its directory, or --tokenizer)"
        )
    return model


def _check_tensor_parallel(config: TrainConfig, model: ModelConfig) -> None:
    """Sizes that ``pipeline.tp`` ranks share evenly, and a layout the plans support."""
    from pipetrain.parallel.tp import TensorParallelError, check_model_divisible

    p = config.pipeline
    try:
        check_model_divisible(model, p.tp)
    except TensorParallelError as exc:
        raise ConfigError(str(exc)) from None
    if p.sequence_parallel and model.family == "gpt2":
        raise ConfigError(
            "pipeline.sequence_parallel is not supported with gpt2's learned positions: "
            "drop --sequence-parallel, or use a llama model"
        )
    if p.sequence_parallel and config.data.seq_len % p.tp:
        raise ConfigError(
            f"pipeline.sequence_parallel splits data.seq_len {config.data.seq_len} over "
            f"pipeline.tp {p.tp} ranks: use a --seq-len that {p.tp} divides"
        )


def _prepare_schedule(config: TrainConfig, *, tied_embeddings: bool) -> PreparedSchedule:
    """pipeline.schedule prepared (``pipetrain.schedules.prepare``), with the checks of
    the settings it must fit before and after; each error names the setting."""
    p = config.pipeline
    from_file = is_schedule_file(p.schedule)
    if from_file:
        _check_file_settings(config)
    else:
        _check_builtin_settings(config, tied_embeddings=tied_embeddings)
    try:
        prepared = prepare_schedule(
            p.schedule,
            p.pp,
            p.microbatches,
            p.chunks if p.chunks > 1 else None,
            early=p.early_grads,
        )
    except InputError as exc:
        key = "pipeline.schedule" if from_file else "pipeline"
        raise ConfigError(f"{key}: {exc}") from None
    if from_file:
        _check_loaded(config, prepared.schedule, tied_embeddings=tied_embeddings)
    return prepared


def _check_builtin_settings(config: TrainConfig, *, tied_embeddings: bool) -> None:
    p = config.pipeline
    from pipetrain.schedules.registry import get_spec

    try:
        family = get_spec(p.schedule)
    except InputError as exc:
        raise ConfigError(
            f"pipeline.schedule: {exc}, or give a schedule file ending in .csv or .json"
        ) from None
    if p.chunks > 1 and not family.uses_chunks:
        raise ConfigError(
            f"pipeline.chunks {p.chunks} needs a schedule with several stages per rank "
            f"(interleaved-1f1b, looped-bfs); {p.schedule} has a fixed number: drop --chunks"
        )
    from pipetrain.train.pipedream.plan import check_async

    check_async(config, asynchronous=family.asynchronous, tied_embeddings=tied_embeddings)


def _check_file_settings(config: TrainConfig) -> None:
    p = config.pipeline
    if p.chunks > 1:
        raise ConfigError(
            f"pipeline.chunks {p.chunks}: a schedule file fixes the stages per rank by the "
            "stages each row runs: drop --chunks"
        )


def _check_loaded(config: TrainConfig, schedule: Schedule, *, tied_embeddings: bool) -> None:
    """A user's schedule file (``pipetrain simulate --save`` writes one), loaded: what the
    settings need of it."""
    p = config.pipeline
    if schedule.microbatches != p.microbatches:
        raise ConfigError(
            f"pipeline.schedule: {p.schedule} has {schedule.microbatches} micro-batches, not the "
            f"{p.microbatches} of pipeline.microbatches: use --microbatches "
            f"{schedule.microbatches}"
        )
    if schedule.asynchronous:
        # The trainer's asynchronous runs rebuild their streams by name (pipedream,
        # pipedream-2bw) to fit evaluation and checkpoints, which a fixed file cannot.
        raise ConfigError(
            f"pipeline.schedule: {p.schedule} is asynchronous (weights change inside a step), "
            "which train runs only by name: use --schedule pipedream or pipedream-2bw"
        )
    from pipetrain.train.pipedream.plan import check_async

    check_async(config, asynchronous=False, tied_embeddings=tied_embeddings)


def _stage_layers(
    config: TrainConfig, model: ModelConfig, schedule: Schedule
) -> tuple[tuple[int, ...], ...]:
    """The layers of each model stage: pipeline.split, else pipeline.balance."""
    p = config.pipeline
    if not p.split and p.balance == "uniform":
        return block_split(model.n_layers, schedule.placement.num_model_stages)
    from pipetrain.partition import PartitionError, split_layers

    try:
        return split_layers(
            model,
            schedule.placement,
            split=p.split or None,
            method=p.balance,
            seq_len=config.data.seq_len,
        )
    except PartitionError as exc:
        key = "pipeline.split" if p.split else "pipeline.balance"
        raise ConfigError(f"{key}: {exc}") from None


def _check_optional_packages(config: TrainConfig, reporter: bool) -> None:
    """Packages that only some options need, checked before any process starts. Only
    rank 0 writes TensorBoard events and the timeline picture: the other nodes of a
    torchrun launch need not have those packages."""
    needs = (
        (
            reporter and config.run.tensorboard,
            "tensorboard",
            "run.tensorboard",
            "drop --tensorboard",
        ),
        (
            reporter and config.run.timeline.endswith(".png"),
            "matplotlib",
            "run.timeline",
            "drop --timeline, or write a trace: --timeline step.json",
        ),
        (
            bool(config.data.tokenizer),
            "tokenizers",
            "data.tokenizer",
            "leave it empty for byte tokens",
        ),
    )
    for wanted, package, key, instead in needs:
        if wanted and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"{key} needs the '{package}' package, which is not installed: "
                f"pip install {package}, or {instead}"
            )


def threads_per_process(setting: int, local_processes: int) -> int:
    """Torch threads for each of ``local_processes`` on this machine (``setting`` 0 = share)."""
    if setting > 0:
        return setting
    return max(1, (os.cpu_count() or 1) // max(1, local_processes))


def _moe_settings(config: TrainConfig, model: ModelConfig) -> ModelConfig:
    """The model with the run's MoE options (capacity) and checked against --ep."""
    p = config.pipeline
    if not 0 <= config.model.capacity_factor < math.inf:
        raise ConfigError(
            f"model.capacity_factor is {config.model.capacity_factor!r}: use 0 (dropless) or "
            f"a positive factor such as 1.25"
        )
    if config.model.capacity_factor > 0:
        if not model.n_experts:
            raise ConfigError(
                f"model.capacity_factor drops tokens routed to experts, but model "
                f"{model.name!r} is dense: pick a MoE model or drop --capacity-factor"
            )
        model = dataclasses.replace(model, capacity_factor=config.model.capacity_factor)
    _check_expert_parallel(model, p.ep, p.dp, p.shard)
    return model


def _check_expert_parallel(model: ModelConfig, ep: int, dp: int, shard: bool) -> None:
    """One line for each way ``ep`` cannot shard ``model``'s experts over ``dp`` replicas."""
    if ep == 1:
        return
    if dp % ep:
        raise ConfigError(
            f"--ep {ep} does not divide --dp {dp}: expert-parallel groups lie inside the "
            f"data-parallel replicas; use --dp {ep} (or a multiple) or a smaller --ep"
        )
    if shard:
        raise ConfigError(
            "--ep with --shard is not supported yet (experts and FSDP2 shards over one dp "
            "group): drop --shard or --ep"
        )
    if not model.n_experts:
        raise ConfigError(
            f"--ep {ep} shards experts, but model {model.name!r} is dense: pick a MoE model "
            f"(moe-tiny, moe-default) or drop --ep"
        )
    if model.n_experts % ep:
        raise ConfigError(
            f"model {model.name!r} has {model.n_experts} experts per MoE layer, which do not "
            f"split over --ep {ep} ranks: pick an ep that divides {model.n_experts}"
        )
