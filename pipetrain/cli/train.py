"""``pipetrain train``: train a model through the pipeline, from one command.

    pipetrain train                                  # the main job: llama-default, 3 stages, 1F1B
    pipetrain train --pp 4 --schedule zb-h1 --steps 20
    pipetrain train --pp 2 --dp 2                    # 2 replicas of a 2-stage pipeline: 4 processes
    pipetrain train --config configs/default.toml --set optim.warmup_steps=5
    torchrun --nnodes 2 --nproc-per-node 2 ... -m pipetrain.cli train --pp 4   # many nodes

Every config field can be set in the TOML file and overridden by the flags below or by
``--set SECTION.FIELD=VALUE``. torch is imported only once the config is valid.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from pipetrain.cli.plan_auto import add_train_auto_flags, auto_config
from pipetrain.config import TrainConfig, load_config, parse_override
from pipetrain.config.docs import config_fields

__all__ = ["FLAGS", "add_config_flags", "add_parser", "config_from_args", "fields_help", "run"]


def count_or_auto(text: str) -> int | str:
    """An integer, or "auto" (``--microbatches auto``; ``load_config`` maps it)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number or auto") from None


# Flag -> (config key, type, help). A flag that is not given leaves the file's value.
FLAGS: dict[str, tuple[str, Any, str]] = {
    "--model": ("model.name", str, "model preset (llama-default, llama-tiny, gpt2-tiny, ...)"),
    "--init-from": (
        "model.init_from",
        str,
        "a local Hugging Face model directory to start from (Llama, Mistral, Qwen2, Mixtral, GPT-2)",
    ),
    "--pp": ("pipeline.pp", int, "pipeline ranks (processes); 1 = one stage in this process"),
    "--dp": ("pipeline.dp", int, "data-parallel replicas of the pipeline (pp x dp processes)"),
    "--tp": (
        "pipeline.tp",
        int,
        "tensor-parallel ranks per stage: each layer split over tp processes (pp x dp x tp)",
    ),
    "--ep": (
        "pipeline.ep",
        int,
        "expert-parallel ranks (MoE models): experts split over ep of the --dp replicas",
    ),
    "--capacity-factor": (
        "model.capacity_factor",
        float,
        "MoE: drop token assignments beyond this x an expert's fair share (0: dropless)",
    ),
    "--chunks": ("pipeline.chunks", int, "stages per rank (interleaved and looped schedules)"),
    "--schedule": (
        "pipeline.schedule",
        str,
        "schedule name (1f1b, gpipe, interleaved-1f1b, zb-h1, zb-v, ...) or a .csv/.json "
        "schedule file (simulate --save writes one)",
    ),
    "--microbatches": (
        "pipeline.microbatches",
        count_or_auto,
        "micro-batches per pipeline step, or auto: the first steps try counts near the "
        "configured one and the run keeps the fastest (pipeline.microbatches_auto)",
    ),
    "--split": ("pipeline.split", str, "blocks per stage, e.g. 4,3,5 (default: by --balance)"),
    "--balance": (
        "pipeline.balance",
        str,
        "uniform (even blocks, default), params or cost (estimated FLOPs)",
    ),
    "--batch-size": ("data.batch_size", int, "sequences per pipeline step"),
    "--seq-len": ("data.seq_len", int, "tokens per sequence"),
    "--steps": ("run.steps", int, "optimizer steps"),
    "--lr": ("optim.lr", float, "peak learning rate"),
    "--seed": ("run.seed", int, "seed of weights and batch order"),
    "--data": (
        "data.path",
        str,
        "text file, folder of text files or .jsonl (default: Python's stdlib source)",
    ),
    "--tokenizer": ("data.tokenizer", str, "local tokenizer.json (default: bytes)"),
    "--metrics": ("run.metrics", str, "metrics JSONL file (default: runs/<name>/metrics.jsonl)"),
    "--precision": ("pipeline.precision", str, "fp32 or bf16 (autocast, fp32 master weights)"),
    "--device": ("pipeline.device", str, "auto, cpu or cuda"),
    "--name": ("run.name", str, "run directory name under runs/"),
    "--grad-accum": ("optim.grad_accum", int, "pipeline steps per optimizer step"),
    "--eval-every": ("run.eval_every", int, "evaluate every N steps (0: start and end only)"),
    "--timeline": (
        "run.timeline",
        str,
        "draw the measured timeline of the last step to this PNG, or a Chrome/Perfetto trace .json",
    ),
    "--profile": (
        "run.profile",
        str,
        "torch.profiler on these steps (5-6 or 3): traces and top operators in runs/<name>/profile",
    ),
    "--checkpoint-dir": ("run.checkpoint_dir", str, "save checkpoints into this directory"),
    "--checkpoint-every": (
        "run.checkpoint_every",
        int,
        "save every N steps (0: at a stop, the end)",
    ),
    "--keep": ("run.keep", int, "keep the newest N checkpoints (0: all)"),
    "--grad-report": (
        "run.grad_report",
        int,
        "report every parameter's gradient at step 1 and every N steps (runs/<name>/grad_report.jsonl)",
    ),
    "--stream-steps": ("pipeline.stream_steps", int, "pipedream(-2bw): steps between drains"),
    "--recompute-ranks": (
        "pipeline.recompute_ranks",
        str,
        "only these pipeline ranks recompute, e.g. 0,1",
    ),
}
SWITCHES: dict[str, tuple[str, str]] = {
    "--recompute": ("pipeline.recompute", "recompute each block's activations in backward"),
    "--compile": ("pipeline.compile", "torch.compile each stage"),
    "--single-process": ("pipeline.single_process", "run every rank in this process (debug mode)"),
    "--shard": ("pipeline.shard", "shard each stage over the --dp replicas (FSDP2 fully_shard)"),
    "--grad-as-bucket-view": (
        "pipeline.grad_as_bucket_view",
        "with --dp: .grad as views of persistent all-reduce buckets (no copies)",
    ),
    "--sequence-parallel": (
        "pipeline.sequence_parallel",
        "with --tp: norms and residuals on 1/tp of the sequence",
    ),
    "--tensorboard": ("run.tensorboard", "write TensorBoard logs (needs tensorboard)"),
    "--resume": ("run.resume", "continue from the newest valid checkpoint in --checkpoint-dir"),
    "--vertical-sync": ("pipeline.vertical_sync", "pipedream: stage 0's weight version for all"),
}
# Switches that turn off a field whose default is on.
OFF_SWITCHES: dict[str, tuple[str, str]] = {
    "--no-early-grads": (
        "pipeline.early_grads",
        "run every backward of a built-in schedule whole (no early input gradients)",
    ),
}


def _dest(flag: str) -> str:
    return "cfg_" + flag.lstrip("-").replace("-", "_")


def add_config_flags(p: argparse.ArgumentParser, *, skip: frozenset[str] = frozenset()) -> None:
    """The flags of every config field a user sets often, plus --config and --set."""
    p.add_argument("--config", metavar="FILE", help="TOML config file (flags override it)")
    for flag, (key, kind, text) in FLAGS.items():
        if flag in skip:
            continue
        metavar = key.rsplit(".", 1)[1].upper()
        p.add_argument(
            flag, dest=_dest(flag), type=kind, default=None, metavar=metavar, help=f"{text} [{key}]"
        )
    for flag, (key, text) in (SWITCHES | OFF_SWITCHES).items():
        p.add_argument(
            flag, dest=_dest(flag), action="store_true", default=None, help=f"{text} [{key}]"
        )
    p.add_argument(
        "--set",
        dest="cfg_set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="set any config field, e.g. --set optim.warmup_steps=5 (repeatable)",
    )


def config_from_args(
    args: argparse.Namespace,
    extra: dict[str, Any] | None = None,
    default_name: str = "",
    notes: list[str] | None = None,
) -> TrainConfig:
    """Defaults, then --config, then --set, then the flags, then ``extra``; the run is
    named ``default_name`` when none of them names it; a default adapted to them is noted
    in ``notes`` (``load_config``)."""
    overrides: dict[str, Any] = dict(parse_override(text) for text in args.cfg_set)
    for flag, (key, _, _) in FLAGS.items():
        value = getattr(args, _dest(flag), None)
        if value is not None:
            overrides[key] = value
    for switches, value in ((SWITCHES, True), (OFF_SWITCHES, False)):
        for flag, (key, _) in switches.items():
            if getattr(args, _dest(flag)):
                overrides[key] = value
    overrides.update(extra or {})
    return load_config(args.config, overrides, default_name=default_name, notes=notes)


def fields_help() -> str:
    """Every config field with its default and the string under its declaration
    (``pipetrain.config.docs``): the epilog of ``pipetrain train --help``."""
    lines = ["config fields, set in the --config file or by --set SECTION.FIELD=VALUE:"]
    for f in config_fields():
        lines.append(f"  {f.key} = {json.dumps(f.default)}")
        if f.doc:
            lines.append(f"      {f.doc}")
    return "\n".join(lines)


class _LinesFormatter(argparse.HelpFormatter):
    """Wraps each line of a description or epilog on its own, keeping its indentation
    (one line of text wraps as argparse's own formatter wraps it)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        filled = []
        for line in text.splitlines():
            words = " ".join(line.split())
            pad = indent + " " * (len(line) - len(line.lstrip(" ")))
            filled.append(textwrap.fill(words, width, initial_indent=pad, subsequent_indent=pad))
        return "\n".join(filled)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a model through the pipeline (default: the 12-layer main job)",
        description="Train a model through the pipeline. Without flags: llama-default on 3 "
        "stages x 4 blocks, batch 32 in 8 micro-batches of 4, seq 128, 1F1B, on the Python "
        "standard library's source. --pp P starts P local processes; under torchrun the "
        "processes come from torchrun.",
        epilog=fields_help(),
        formatter_class=_LinesFormatter,
    )
    add_config_flags(p)
    add_train_auto_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pipetrain.launch.role import role_from_env

    role = role_from_env()
    notes: list[str] = []
    try:
        config = auto_config(config_from_args(args, notes=notes), args)
        if _chunks_given(args):
            from pipetrain.train.preflight import check_chunks_given

            check_chunks_given(config)
        if role is not None:
            # An elastic restart with fewer processes continues the run re-planned.
            from pipetrain.config.elastic import fit_world

            refit = fit_world(config, role.world_size)
            config = refit.config
            notes += [refit.note] if refit.note else []
    except Exception as exc:
        if role is not None:
            # Under torchrun the other nodes would wait for this process until the timeout.
            from pipetrain.launch.rendezvous import report_failure

            report_failure(role, exc)
        raise
    return run_config(config, notes)


def _chunks_given(args: argparse.Namespace) -> bool:
    """Whether the user set pipeline.chunks (a flag, --set or the --config file): its
    default, 1, stands for "the schedule's own number", a 1 given is a request."""
    if getattr(args, _dest("--chunks"), None) is not None:
        return True
    if any(text.partition("=")[0].strip() == "pipeline.chunks" for text in args.cfg_set):
        return True
    if args.config is None:
        return False
    import tomllib

    try:
        with open(args.config, "rb") as file:
            table = tomllib.load(file).get("pipeline", {})
    except (OSError, tomllib.TOMLDecodeError):
        return False  # load_config read it a moment ago; nothing to add here
    # A config that pipetrain wrote (runs/<name>/config.toml, plan --auto --out) holds every
    # field, chunks = 1 included: in a file, 1 keeps its meaning of "the schedule's own".
    return isinstance(table, dict) and table.get("chunks", 1) != 1


def run_config(config: TrainConfig, notes: Sequence[str] = ()) -> int:
    """Train with a resolved config in the right kind of process(es); the exit status.

    ``notes``: lines about defaults the config adapted, printed once it is found usable.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from pipetrain.config.lock import RunLock
    from pipetrain.config.run_folder import announce, lock_run
    from pipetrain.data import load_tokenizer
    from pipetrain.errors import RunFailed
    from pipetrain.launch.local import LaunchFailed, launch_local, rank_preload
    from pipetrain.launch.role import ProcessRole, role_from_env
    from pipetrain.runtime import PipelineError
    from pipetrain.train.loop import train
    from pipetrain.train.plan import plan_run
    from pipetrain.train.preflight import preflight

    role = role_from_env()
    lock: RunLock | None = None
    try:
        if role is not None:
            if role.reporter:
                sys.stdout.writelines(f"{note}\n" for note in notes)
            return _train_rank(config, role)
        # Everything checkable is checked before any process starts, files included.
        plan = plan_run(config, vocab_size=load_tokenizer(config.data.tokenizer).vocab_size)
        # This process holds the run's folders from before the checkpoints are read (a
        # live run's, mid-save, are not) until the run ends (pipetrain.config.lock).
        lock = lock_run(config)
        preflight(config, plan)
        processes = config.pipeline.processes
        preload = rank_preload(config) if processes > 1 else ""
        sys.stdout.writelines(f"{note}\n" for note in notes)
        announce(config, sys.stdout, lock)
        lock.hand_over()  # the ranks' locks, to rank 0: held until it is gone
        if processes == 1:
            train(config, ProcessRole(), announced=True)
            return 0
        launch_local(
            config.run_dir / "config.toml",
            processes,
            entry="pipetrain.train.loop:train",
            preload=preload,
        )
        return 0
    except (RunFailed, PipelineError) as exc:
        sys.stderr.write(f"pipetrain train: {exc}\n")
        return 1
    except LaunchFailed as exc:
        sys.stderr.write(f"pipetrain train: {exc}\n")
        return exc.exit_code
    except SignalException as exc:
        # The launcher passed SIGTERM/SIGINT on to the ranks, which finish their step, save
        # (with --checkpoint-dir) and exit 0: a stop asked for is not a failure.
        sys.stderr.write(f"pipetrain train: stopped by signal {exc.sigval.name}\n")
        return 0
    finally:
        if lock is not None:
            lock.release()


def _train_rank(config: TrainConfig, role: Any) -> int:
    """One rank under torchrun; a collective broken by a lost or silent peer is one line,
    and bad input that every rank found alike is said by the first rank of each node."""
    from pipetrain.errors import InputError, raised_on_every_rank
    from pipetrain.runtime.errors import lost_peer_error
    from pipetrain.train.loop import train

    try:
        train(config, role)
    except InputError as exc:
        if role.local_rank != 0 and raised_on_every_rank(exc):
            return 2  # the first rank of this node prints it
        raise
    except Exception as exc:
        failure = lost_peer_error(exc, rank=role.rank, timeout_s=config.pipeline.timeout_s)
        if failure is None or failure is exc:
            raise
        raise failure from None
    return 0
