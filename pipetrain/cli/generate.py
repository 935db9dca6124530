"""``pipetrain generate``: text from a checkpoint, through the model cut into stages.

    pipetrain generate --checkpoint DIR --prompt TEXT [--max-new-tokens N]
                       [--temperature T] [--pp P] [--seed S] [--device auto|cpu|cuda]

DIR is a checkpoint or a checkpoint directory (its newest valid checkpoint). ``--pp P``
splits the model into P stages run one after the other in this process; started by
torchrun (``torchrun --nproc-per-node P -m pipetrain.cli generate ...``), each rank holds
one stage and hidden states travel between the ranks.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

from pipetrain.cli.errors import UsageError

__all__ = ["add_parser", "run"]

# How long a rank waits for the others to start and for each transfer: the trainer's
# default pipeline.timeout_s.
_TIMEOUT_S = 300.0


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text from a checkpoint through the pipeline stages",
        description="Generate text from a checkpoint, running the model as pipeline stages.",
    )
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="checkpoint (directory)")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=100, metavar="N", help="default 100")
    p.add_argument(
        "--temperature", type=float, default=0.8, metavar="T", help="0 = greedy (default 0.8)"
    )
    p.add_argument(
        "--pp",
        type=int,
        default=None,
        metavar="P",
        help="pipeline stages (default 1, or the number of ranks under torchrun)",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens is {args.max_new_tokens}: use 0 or more")
    # NaN crashed the sampler; inf sampled uniformly, ignoring the model.
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UsageError(f"--temperature is {args.temperature}: use 0 (greedy) or a finite number")
    if not 0 <= args.seed < 2**64:
        # torch.Generator.manual_seed takes 64 bits: larger was a ValueError traceback.
        raise UsageError(f"--seed is {args.seed}: use 0 to {2**64 - 1}")
    if args.pp is not None and args.pp < 1:
        raise UsageError(f"--pp is {args.pp}: use 1 or more stages")

    import torch
    import torch.distributed as dist

    from pipetrain.checkpoint.generate import generate_tokens, load_pipeline_model
    from pipetrain.cli.ckpt import reading, resolve_checkpoint
    from pipetrain.data import load_tokenizer
    from pipetrain.launch.rendezvous import join_process_group
    from pipetrain.launch.role import ProcessRole
    from pipetrain.runtime.device import gpu_identity, use_device

    path = resolve_checkpoint(args.checkpoint)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world > 1 and args.pp not in (None, world):
        raise UsageError(
            f"--pp {args.pp} but torchrun started {world} ranks: pass --pp {world} or leave it out"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but no CUDA device is available: use --device cpu")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = (
        torch.device("cuda", local_rank % torch.cuda.device_count())
        if use_cuda
        else torch.device("cpu")
    )
    # Before the process group: loading the checkpoint broadcasts objects, on nccl from
    # the current device.
    use_device(device)
    group = None
    if world > 1:
        # The trainer's start: two ranks on one GPU are named there, in one line.
        role = ProcessRole(
            rank=int(os.environ.get("RANK", "0")), world_size=world, local_rank=local_rank
        )
        join_process_group(role, "nccl" if use_cuda else "gloo", _TIMEOUT_S, gpu_identity(device))
        group = dist.group.WORLD
    try:
        stages = world if world > 1 else (args.pp or 1)
        with reading(path):
            model = load_pipeline_model(path, pp=stages, device=device, group=group)
        data = dict(model.manifest.config.get("data", {}))
        tokenizer = load_tokenizer(str(data.get("tokenizer", "")))
        context = int(data["seq_len"]) if "seq_len" in data else None
        prompt = _prompt_tokens(args.prompt, tokenizer)
        window = min(context or model.config.max_seq_len, model.config.max_seq_len)
        if len(prompt) + args.max_new_tokens > window and _rank() == 0:
            sys.stderr.write(_past_the_context(len(prompt), args.max_new_tokens, window))
        result = generate_tokens(
            model,
            prompt,
            new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
            device=device,
            context=context,
        )
    finally:
        if group is not None:
            dist.destroy_process_group()
    if _rank() == 0:  # every rank has the text; one prints it
        _write(args.prompt + tokenizer.decode(result.tokens) + "\n")
    return 0


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _prompt_tokens(prompt: str, tokenizer: Any) -> list[int]:
    """The prompt's token ids. Bytes of the command line that are not UTF-8 reach Python
    as lone surrogates (surrogateescape): byte tokens take them as the bytes they were
    (``ByteTokenizer``); a tokenizer.json reads only text, so they are refused."""
    from pipetrain.data import ByteTokenizer

    if not isinstance(tokenizer, ByteTokenizer) and not _is_utf8(prompt):
        raise UsageError(
            "--prompt holds bytes that are not UTF-8, and the checkpoint's tokenizer.json "
            "reads only text: give the prompt as UTF-8 text"
        )
    return list(tokenizer.encode(prompt))


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _past_the_context(prompt: int, new: int, window: int) -> str:
    """The one line that says what a generation longer than the model's context does."""
    return (
        f"pipetrain generate: note: {prompt} prompt and {new:,} new tokens are more than the "
        f"model's context of {window}: each token past it sees only the {window} before it "
        f"(a sliding window), one forward pass per new token, and the text is printed at the "
        f"end; lower --max-new-tokens for less\n"
    )


def _write(text: str) -> None:
    """``text`` on stdout; a prompt's bytes that were not UTF-8 go out as they came in."""
    if _is_utf8(text):
        sys.stdout.write(text)
        return
    sys.stdout.flush()
    sys.stdout.buffer.write(text.encode("utf-8", errors="surrogateescape"))
    sys.stdout.buffer.flush()
