"""``pipetrain ckpt``: check, describe and export checkpoints.

    pipetrain ckpt verify DIR            # checksums and completeness; exit 0 valid, 1 not
    pipetrain ckpt inspect DIR [--json]  # step, config, layout, tensors and sizes
    pipetrain ckpt export DIR --out FILE.safetensors [--format native]
    pipetrain ckpt export DIR --out HF_DIR --format hf   # a directory transformers loads

DIR is one checkpoint (``.../step_000100``) or a checkpoint directory holding several:
verify then checks every one, inspect and export take the newest valid one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipetrain.cli.errors import UsageError
from pipetrain.errors import InputError

__all__ = ["add_parser", "reading", "resolve_checkpoint", "run"]


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "ckpt",
        help="verify, inspect or export a checkpoint",
        description="Verify, inspect or export a pipetrain checkpoint.",
    )
    actions = p.add_subparsers(dest="ckpt_command", metavar="ACTION", parser_class=type(p))
    actions.required = True
    verify = actions.add_parser(
        "verify", help="check every file against the manifest (exit 0 valid, 1 not)"
    )
    verify.add_argument("dir", metavar="DIR", help="a checkpoint, or a directory of them")
    inspect = actions.add_parser("inspect", help="step, config, layout, tensors and sizes")
    inspect.add_argument("dir", metavar="DIR", help="a checkpoint, or a directory of them")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    export = actions.add_parser(
        "export", help="consolidated weights: one safetensors file, or a Hugging Face directory"
    )
    export.add_argument("dir", metavar="DIR", help="a checkpoint, or a directory of them")
    export.add_argument(
        "--out",
        required=True,
        metavar="PATH",
        help="the .safetensors file to write (--format hf: the directory to write)",
    )
    export.add_argument(
        "--format",
        default="native",
        choices=("native", "hf"),
        help="native: pipetrain's global names (default); hf: a Hugging Face model directory "
        "(config.json, model.safetensors, tokenizer.json) for Llama, Qwen2 or GPT-2",
    )
    p.set_defaults(run=run)


def resolve_checkpoint(directory: str) -> Path:
    """One checkpoint directory: DIR itself, or the newest valid one under it."""
    from pipetrain.checkpoint import choose_resume, list_checkpoints
    from pipetrain.checkpoint.manifest import COMPLETE_MARKER, MANIFEST_NAME

    path = Path(directory)
    if not path.is_dir():
        raise UsageError(f"checkpoint {directory}: no such directory; pass a checkpoint directory")
    if (path / MANIFEST_NAME).exists() or (path / COMPLETE_MARKER).exists():
        return path
    choice = choose_resume(path)
    if choice.path is None and choice.skipped:
        # Every one failed verification: saying they lack a COMPLETE marker would send the
        # user looking for the wrong problem.
        newest_path = list_checkpoints(path).complete[-1][1]
        newest = choice.skipped[0].removeprefix(f"skipping {newest_path}: ")
        more = f" (and {len(choice.skipped) - 1} more damaged)" if len(choice.skipped) > 1 else ""
        raise UsageError(
            f"checkpoint {directory}: no valid checkpoint: {newest}{more}; restore the "
            "damaged files, or pass another checkpoint"
        )
    if choice.path is None:
        raise UsageError(
            f"checkpoint {directory}: holds no valid checkpoint (step_NNNNNN with a COMPLETE "
            "marker); pass a checkpoint directory"
        )
    return choice.path


@contextlib.contextmanager
def reading(path: Path) -> Iterator[None]:
    """Reads of the checkpoint ``path``. A training run saving into the same directory with
    ``--keep`` deletes its oldest checkpoints: one deleted while being read fails as a
    missing or unreadable file, which would call it damaged; it is said to be gone."""
    try:
        yield
    except (InputError, OSError):
        if path.exists():
            raise
        raise UsageError(
            f"checkpoint {path} was deleted while being read (a training run saving there "
            f"with --keep removes its oldest): run the command again to read the newest"
        ) from None


def run(args: argparse.Namespace) -> int:
    handlers = {"verify": _verify, "inspect": _inspect, "export": _export}
    code: int = handlers[args.ckpt_command](args)
    return code


def _verify(args: argparse.Namespace) -> int:
    from pipetrain.checkpoint import list_checkpoints, verify_checkpoint
    from pipetrain.checkpoint.manifest import COMPLETE_MARKER, MANIFEST_NAME

    path = Path(args.dir)
    if not path.is_dir():
        raise UsageError(f"checkpoint {args.dir}: no such directory; pass a checkpoint directory")
    is_single = (path / MANIFEST_NAME).exists() or (path / COMPLETE_MARKER).exists()
    found = list_checkpoints(path)
    targets = [path] if is_single else [p for _, p in found.complete]
    partials = [] if is_single else found.partial
    if not targets:
        for partial in partials:
            print(f"note {partial}: an unfinished save, ignored")
        print(f"{path}: no checkpoints (step_NNNNNN directories) found")
        return 1
    bad = 0
    for target in targets:
        result = verify_checkpoint(target)
        if not target.exists():
            # Listed, then deleted by a training run's --keep: gone, not damaged.
            print(f"note {target}: deleted while being verified (a training run's --keep)")
            continue
        if result.ok and result.manifest is not None:
            files = result.manifest.files
            total = sum(f.size for f in files)
            print(f"ok {target}: step {result.manifest.step}, {len(files)} files, {total} bytes")
        else:
            bad += 1
            for problem in result.problems:
                print(f"BAD {target}: {problem}")
    for partial in partials:
        print(f"note {partial}: an unfinished save, ignored")
    return 1 if bad else 0


def _inspect(args: argparse.Namespace) -> int:
    from pipetrain.checkpoint import read_manifest, verify_checkpoint
    from pipetrain.checkpoint.load import tensor_metadata

    path = resolve_checkpoint(args.dir)
    with reading(path):
        manifest = read_manifest(path)
        problems: tuple[str, ...] = ()
        if path == Path(args.dir):
            # Named directly, so not verified on the way (a directory of checkpoints yields
            # only a valid one): say it is damaged before describing it, and before DCP
            # unpickles a metadata file that may be what is damaged.
            problems = verify_checkpoint(path).problems
            for problem in problems:
                print(f"warning: damaged checkpoint: {problem}", file=sys.stderr)
        tensors = tensor_metadata(path)

    def nbytes(size: Any, dtype: Any) -> int:
        count = 1
        for d in size:
            count *= int(d)
        return count * int(dtype.itemsize)

    model_tensors = {k: v for k, v in tensors.items() if k.startswith("model/")}
    params = sum(nbytes(size, dtype) // dtype.itemsize for size, dtype in model_tensors.values())
    if args.json:
        report = manifest.to_json()
        report["path"] = str(path)
        report["problems"] = list(problems)
        report["parameters"] = params
        report["tensors"] = {
            k: {
                "shape": list(size),
                "dtype": str(dtype).removeprefix("torch."),
                "bytes": nbytes(size, dtype),
            }
            for k, (size, dtype) in sorted(tensors.items())
        }
        json.dump(report, sys.stdout, indent=1)
        print()
        return 0
    total = sum(f.size for f in manifest.files)
    layout = manifest.layout
    print(f"checkpoint {path}")
    print(f"  step {manifest.step}, format version {manifest.format_version}")
    print(f"  {len(manifest.files)} files, {total} bytes; {params} model parameters")
    print(
        f"  layout: pp={layout.pp} chunks={layout.chunks} schedule={layout.schedule or '-'} "
        f"world_size={layout.world_size}"
    )
    for stage, layers in enumerate(layout.stages):
        print(f"    stage {stage}: layers {list(layers)}")
    print("  model: " + json.dumps(dict(manifest.model), sort_keys=True))
    print("  config: " + json.dumps(dict(manifest.config), sort_keys=True))
    print("  trainer: " + json.dumps(dict(manifest.trainer), sort_keys=True))
    print("  tensors:")
    width = max((len(k) for k in tensors), default=0)
    for key, (size, dtype) in sorted(tensors.items()):
        shape = "x".join(str(int(d)) for d in size) or "scalar"
        kind = str(dtype).removeprefix("torch.")
        print(f"    {key:<{width}}  {kind:<8} {shape:<14} {nbytes(size, dtype)} bytes")
    return 0


def _export(args: argparse.Namespace) -> int:
    from pipetrain.checkpoint.export import export_checkpoint

    path = resolve_checkpoint(args.dir)
    with reading(path):
        result = export_checkpoint(path, args.out, format=args.format)
    # A directory of checkpoints exports its newest valid one: say which.
    print(
        f"wrote {result.path}: {result.tensors} tensors, {result.bytes} bytes "
        f"({result.format}), from {path}"
    )
    return 0
