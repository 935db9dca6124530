"""Checkpoint save and load: pipetrain (DCP, manifest, checksums) against torch.save.

    .venv/bin/python benchmarks/bench_checkpoint.py [--d-model 768] [--layers 12] [--reps 3]
                                                    [--ranks 2] [--dir /tmp/bench_ckpt]

The state is a Llama-style model (byte vocabulary) with AdamW moments after one step:
weights + exp_avg + exp_avg_sq, about 3x the weights. Compared, on one process:
``torch.save`` of the model and optimizer state dicts (then fsync, as a checkpoint
must), and ``torch.load`` + ``load_state_dict``; pipetrain's ``save_checkpoint`` (DCP,
fsync, sha256 of every file, manifest, atomic rename) and ``load_checkpoint`` with and
without re-hashing the files, with one and with two writer (and hashing) threads. With ``--ranks R`` the pipetrain save and load also run
on R gloo processes, each holding 1/R of the layers and writing its own file. Reads
come from the page cache after a write: the load times are those of a warm cache.
Prints a Markdown table (medians of ``--reps``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pipetrain.checkpoint import load_checkpoint, save_checkpoint
from pipetrain.launch.process_exit import exit_rank
from pipetrain.models import build_stage, get_model_config, model_spec


def build(args: argparse.Namespace, rank: int, ranks: int):
    config = get_model_config(
        "llama-default",
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.d_model // 64,
        n_kv_heads=max(1, args.d_model // 256),
        ffn_hidden=args.d_model * 8 // 3 // 64 * 64,
    )
    spec = model_spec(config)
    n = len(spec)
    bounds = [n * i // ranks for i in range(ranks + 1)]
    module = build_stage(spec, range(bounds[rank], bounds[rank + 1]), seed=0, device="cpu")
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    for p in module.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    fields = dataclasses.asdict(config)
    fields.pop("name")
    return module, optimizer, fields


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def torch_save_load(module, optimizer, path: Path) -> tuple[float, float, int]:
    def save() -> None:
        with open(path, "wb") as f:
            torch.save({"model": module.state_dict(), "optim": optimizer.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())

    def load() -> None:
        state = torch.load(path, weights_only=True)
        module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    return timed(save), timed(load), path.stat().st_size


def pipetrain_save_load(module, optimizer, fields, root: Path, step: int, group=None, threads=1):
    result = save_checkpoint(
        root,
        step,
        modules=module,
        optimizer=optimizer,
        model=fields,
        keep=1,
        threads=threads,
        group=group,
    )
    hashed = load_checkpoint(
        result.path,
        modules=module,
        optimizer=optimizer,
        model=fields,
        threads=threads,
        group=group,
    ).seconds
    unhashed = load_checkpoint(
        result.path,
        modules=module,
        optimizer=optimizer,
        model=fields,
        checksums=False,
        group=group,
    ).seconds
    return result.seconds, hashed, unhashed, result.bytes


def worker(args: argparse.Namespace) -> None:
    """One rank of the multi-process measurement (started by torchrun)."""
    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    module, optimizer, fields = build(args, rank, ranks)
    rows = []
    for rep in range(args.reps):
        dist.barrier()
        rows.append(pipetrain_save_load(module, optimizer, fields, Path(args.dir) / "dist", rep))
    if rank == 0:
        Path(args.dir, "dist.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def median(values) -> float:
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--ranks", type=int, default=2, help="also run pipetrain on R ranks (0: no)"
    )
    parser.add_argument("--dir", default="/tmp/bench_ckpt")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        exit_rank(0)  # not through finalization: gloo's threads can abort it
    out = Path(args.dir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    torch.set_num_threads(1)

    module, optimizer, fields = build(args, 0, 1)
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    plain = [torch_save_load(module, optimizer, out / "plain.pt") for _ in range(args.reps)]
    ours = [
        pipetrain_save_load(module, optimizer, fields, out / "one", rep) for rep in range(args.reps)
    ]
    threaded = [
        pipetrain_save_load(module, optimizer, fields, out / "two", rep, threads=2)
        for rep in range(args.reps)
    ]
    del module, optimizer

    dist_rows = []
    if args.ranks > 1:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(args.ranks),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            __file__,
            "--worker",
            "--d-model",
            str(args.d_model),
            "--layers",
            str(args.layers),
            "--reps",
            str(args.reps),
            "--dir",
            args.dir,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(command, check=True, env=env)
        dist_rows = json.loads((out / "dist.json").read_text())

    mb = 1e6
    print(
        f"\nmodel: d_model {args.d_model}, {args.layers} blocks, weights {weights / mb:.0f} MB "
        f"(fp32), state with AdamW moments; medians of {args.reps}\n"
    )
    print("| method | processes | save s | load s | bytes on disk | save MB/s |")
    print("|---|---|---|---|---|---|")
    size = plain[0][2]
    save_s, load_s = median(r[0] for r in plain), median(r[1] for r in plain)
    print(
        f"| torch.save + fsync / torch.load | 1 | {save_s:.2f} | {load_s:.2f} | {size:,} | "
        f"{size / mb / save_s:.0f} |"
    )
    for label, rows, procs in (
        ("pipetrain", ours, 1),
        ("pipetrain, 2 writer threads,", threaded, 1),
        ("pipetrain", dist_rows, args.ranks),
    ):
        if not rows:
            continue
        save_s = median(r[0] for r in rows)
        size = rows[0][3]
        print(
            f"| {label} save / load (sha256 verified) | {procs} | {save_s:.2f} | "
            f"{median(r[1] for r in rows):.2f} | {size:,} | {size / mb / save_s:.0f} |"
        )
        print(
            f"| {label} load without re-hashing | {procs} | - | "
            f"{median(r[2] for r in rows):.2f} | | |"
        )
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
