"""What the synchronous and the asynchronous trainer share: the data a rank reads, the
run's output, the checks that every rank resolved the same run, and peak memory."""

from __future__ import annotations

import hashlib
from typing import IO, Any

import torch
import torch.distributed as dist

from pipetrain.config import ConfigError, TrainConfig, config_to_dict, settings_disagree
from pipetrain.data import Corpus, DataError, load_corpus
from pipetrain.errors import on_every_rank
from pipetrain.launch.role import ProcessRole
from pipetrain.runtime import Pipeline
from pipetrain.train.metrics import RunOutput, peak_memory_bytes
from pipetrain.train.plan import RunPlan, plan_fingerprint, plans_disagree

__all__ = [
    "check_same_data",
    "check_same_settings",
    "corpus_fingerprint",
    "data_disagree",
    "open_data",
    "open_output",
    "peak_memory_per_rank",
    "per_rank",
]


def open_data(
    config: TrainConfig, pipeline: Pipeline, group: Any
) -> tuple[bool, bool, Corpus | None]:
    """Whether this process holds a first stage (feeds inputs) and a last one (targets),
    and the corpus, loaded only where one of them is; refuses, on every rank of ``group``
    alike, data that some rank cannot read and ranks that read different text.

    The launcher checks the data before it starts any rank (``pipetrain.train.preflight``);
    under torchrun no launcher of ours does, so the ranks decide together here, and the
    error is marked as every rank's: rank 0 prints it once."""
    placement = pipeline.schedule.placement
    first = any(placement.is_first(s) for s in pipeline.stages)
    last = any(placement.is_last(s) for s in pipeline.stages)
    corpus: Corpus | None = None
    problem: DataError | None = None
    if first or last:
        try:
            corpus = load_corpus(config.data)
        except DataError as exc:
            if group is None:
                raise
            problem = exc
    if group is not None:
        check_same_data(corpus, group, problem)
    return first, last, corpus


def check_same_settings(config: TrainConfig, plan: RunPlan) -> None:
    """Refuse, on every rank alike, a run whose processes resolved different settings, or
    derived different pipelines from the same ones."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (config_to_dict(config), plan_fingerprint(plan)))
    problem = settings_disagree([c for c, _ in everyone]) or plans_disagree(
        [f for _, f in everyone], config.pipeline.schedule, config.model.name
    )
    if problem is not None:
        raise ConfigError(problem)


def open_output(config: TrainConfig, role: ProcessRole, out: IO[str]) -> RunOutput:
    """Where a run's progress lines and metrics go (silent on every rank but the reporter)."""
    return RunOutput(
        active=role.reporter,
        total_steps=config.run.steps,
        stream=out,
        metrics_path=config.metrics_path,
        tensorboard_dir=config.run_dir / "tensorboard" if config.run.tensorboard else None,
        # A resumed run keeps the records of its earlier part (truncating lost them).
        resume=config.run.resume,
        progress_bar=config.run.progress_bar,
    )


def corpus_fingerprint(corpus: Corpus) -> tuple[str, int, int]:
    """A digest of the token streams, with their lengths for the message."""
    digest = hashlib.blake2b(digest_size=16)
    for stream in (corpus.train, corpus.eval):
        digest.update(len(stream).to_bytes(8, "little"))
        digest.update(stream.tobytes())
    return digest.hexdigest(), len(corpus.train), len(corpus.eval)


def data_disagree(by_rank: list[tuple[str, int, int] | None]) -> str | None:
    """Why the ranks that read data (``corpus_fingerprint`` of each, None where a rank
    reads none) cannot train together, in one line; None when they read the same tokens.

    The first stage reads the inputs and the last the targets of the same batch index:
    with other text on another node (files that differ under one path, or the default
    corpus of another Python version's standard library) the targets would belong to
    other inputs and the loss would fall for nothing, silently."""
    held = [(rank, f) for rank, f in enumerate(by_rank) if f is not None]
    if not held:
        return None
    (first_rank, first), *rest = held
    for rank, theirs in rest:
        if theirs != first:
            return (
                f"rank {rank} read other data than rank {first_rank} ({theirs[1]:,} train "
                f"and {theirs[2]:,} eval tokens against {first[1]:,} and {first[2]:,}) from the "
                f"same data.path: give every node the same files (the default corpus is the "
                f"running Python's standard library: use one Python version on every node)"
            )
    return None


def check_same_data(corpus: Corpus | None, group: Any, problem: DataError | None = None) -> None:
    """Refuse, on every rank of ``group`` alike, a run whose ranks read different text or
    where some rank could not read its data (``problem``: this rank's error)."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    mine: Any = None if corpus is None else corpus_fingerprint(corpus)
    if problem is not None:
        mine = str(problem)
    dist.all_gather_object(everyone, mine, group=group)
    failed = [(rank, text) for rank, text in enumerate(everyone) if isinstance(text, str)]
    if failed:
        rank, text = failed[0]
        # Rank 0 prints every rank's decision: name the rank whose data it was.
        where = "" if all(t == text for _, t in failed) and rank == 0 else f"rank {rank}: "
        raise on_every_rank(DataError(f"{where}{text}"))
    disagreement = data_disagree(everyone)
    if disagreement is not None:
        raise on_every_rank(DataError(disagreement))


def per_rank(role: ProcessRole, value: int) -> tuple[int, ...]:
    """Every rank's ``value``, in rank order, known on every rank (a collective)."""
    if not role.distributed:
        return (value,)
    everyone: list[Any] = [None] * role.world_size
    dist.all_gather_object(everyone, value)
    return tuple(int(v) for v in everyone)


def peak_memory_per_rank(role: ProcessRole, device: torch.device) -> tuple[int, ...]:
    """Every rank's peak memory in bytes, known on every rank (a collective)."""
    peak = peak_memory_bytes(str(device))
    if not role.distributed:
        return (peak,)
    everyone: list[Any] = [None] * role.world_size
    dist.all_gather_object(everyone, peak)
    return tuple(int(p) for p in everyone)
