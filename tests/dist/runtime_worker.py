"""One rank of the runtime's multi-process checks (started by tests/dist/launch.py).

``runtime_worker.py equal OUT``: every synchronous schedule for this world size, one step
each on llama-tiny, compared with one process on the whole batch (loss and every
gradient to 1e-5 relative) and with the debug mode (bit for bit); with 2 ranks also AdamW
steps (two of them and an evaluation on V and looped schedules, whose wire orders differ
from a program order) and a user CSV schedule, with 4 ranks two 2-rank pipelines side by side (the
second on global ranks 2 and 3). Writes OUT/rank<r>.json.

``runtime_worker.py kill OUT``: rank 1 kills itself in the middle of step 1; the others
must fail with an error naming it (printed to stderr, exit status 1).

``runtime_worker.py stall OUT``: rank 1 stops answering; rank 0 times out naming it.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from pipetrain.launch.process_exit import exit_rank
from pipetrain.models import build_full_model, get_model_config, model_spec
from pipetrain.runtime import PipelineError, build_pipeline, wire_format, wiring
from pipetrain.runtime.stage import token_cross_entropy
from pipetrain.schedules import Schedule
from pipetrain.schedules.early_grads import early_grads
from pipetrain.schedules.io import load_csv
from pipetrain.schedules.registry import build_schedule

RTOL = 1e-5


# Micro-batches of each schedule per world size (as few as the schedule allows, to keep
# 4 processes on 2 cores quick).
SCHEDULES: dict[str, dict[int, int]] = {
    "naive": {2: 1, 4: 1},
    "gpipe": {2: 4, 4: 4},
    "1f1b": {2: 4, 4: 4},
    "interleaved-1f1b": {2: 4, 4: 4},
    "looped-bfs": {2: 4, 4: 4},
    "zb-h1": {2: 4, 4: 4},
    "zb-h2": {2: 4, 4: 8},
    "zb-v": {2: 4, 4: 4},
    "dualpipe-v": {2: 4, 4: 8},
    "v-half": {2: 4, 4: 4},
    "v-min": {2: 4, 4: 4},
    "chimera": {2: 4, 4: 4},
}

# A user's schedule: 1F1B-like on rank 0, split backward with late W's on rank 1.
USER_CSV = """0F0, 0F1, 0F2, 0B0, 0F3, 0B1, 0B2, 0B3
1F0, 1I0, 1F1, 1I1, 1W0, 1F2, 1I2, 1W1, 1F3, 1I3, 1W3, 1W2
"""


# Schedules whose messages between two ranks leave in another order than one side uses
# them (V placements) or interleave both directions of several stages (loops), with v.
WIRE_SCHEDULES = (("zb-v", 2), ("dualpipe-v", 2), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3))


# Side by side, the pipelines' own groups matter, not the schedules: a linear, a looped
# and a bidirectional placement (Chimera's subgroups) suffice.
PAIR_SCHEDULES = ("1f1b", "interleaved-1f1b", "chimera")


def schedules(p: int, out: Path, names: tuple[str, ...] | None = None) -> dict[str, Schedule]:
    cases = {
        name: build_schedule(name, p, by_p[p])
        for name, by_p in SCHEDULES.items()
        if names is None or name in names
    }
    if names is None:
        # Early input gradients: the backwards that another rank waits for split into I and
        # W (some micro-batches of a stage split, the others whole), where they change.
        for name in list(cases):
            early = early_grads(cases[name])
            if early.actions != cases[name].actions:
                cases[f"{name}-early"] = early
    if p == 2 and names is None:
        path = out / f"user-{dist.get_rank()}.csv"
        path.write_text(USER_CSV)
        cases["user-csv"] = load_csv(path)
    return cases


def batch(seed: int, b: int = 8, t: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (b, t + 1), generator=g)
    targets = ids[:, 1:].clone()
    targets[0, :5] = -100
    return ids[:, :-1], targets


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def compare(pipe, debug, ref_grads) -> dict[str, object]:
    """Worst relative gradient error against one process; bitwise equality with debug mode."""
    worst, bitwise, count = 0.0, True, 0
    debug_modules = {s: m for s, m in zip(debug.stages, debug.modules, strict=True)}
    for stage, module in zip(pipe.stages, pipe.modules, strict=True):
        twin = dict(debug_modules[stage].named_parameters(remove_duplicate=False))
        for name, p in module.named_parameters(remove_duplicate=False):
            key = pipe.tied_names.get(name, name)
            worst = max(worst, rel(p.grad, ref_grads[key]))
            bitwise = bitwise and torch.equal(p.grad, twin[name].grad)
            count += 1
    return {"grad_rel": worst, "bitwise": bitwise, "params": count}


def one_step_cases(
    spec, group, p: int, out: Path, prefix: str = "", names: tuple[str, ...] | None = None
) -> dict[str, dict[str, object]]:
    x, y = batch(0)
    full = build_full_model(spec, seed=0, device="cpu")
    ref_loss = token_cross_entropy(full(x), y) / (y != -100).sum()
    ref_loss.backward()
    ref_grads = {n: q.grad for n, q in full.named_parameters()}
    results: dict[str, dict[str, object]] = {}
    for name, schedule in schedules(p, out, names).items():
        kw = dict(
            schedule=schedule,
            microbatches=schedule.microbatches,
            seed=0,
            device="cpu",
            timeout_s=60.0,
        )
        pipe = build_pipeline(spec, group=group, **kw)
        debug = build_pipeline(spec, **kw)
        out = pipe.step(x, y)
        debug_out = debug.step(x, y)
        res = compare(pipe, debug, ref_grads)
        res["loss_rel"] = abs(out.loss - ref_loss.item()) / ref_loss.item()
        res["loss_bitwise"] = out.loss == debug_out.loss
        res["events"] = len(out.timeline.events)
        res["actions"] = sum(len(row) for row in pipe.schedule.actions)
        results[prefix + name] = res
    return results


def accumulation_case(spec, group, schedule: Schedule, steps: int = 3) -> dict[str, object]:
    """``steps`` steps accumulated (no zero_grad between them) against one process and the
    debug mode: the end-of-step sums of tied copies and replicas must not count the earlier
    steps' gradients once per copy."""
    full = build_full_model(spec, seed=0, device="cpu")
    kw = dict(schedule=schedule, microbatches=schedule.microbatches, seed=0, device="cpu")
    pipe = build_pipeline(spec, group=group, timeout_s=60.0, **kw)
    debug = build_pipeline(spec, **kw)
    for step in range(steps):
        x, y = batch(40 + step)
        (token_cross_entropy(full(x), y) / (y != -100).sum()).backward()
        pipe.step(x, y)
        debug.step(x, y)
    return compare(pipe, debug, {n: q.grad for n, q in full.named_parameters()})


def adamw_case(spec, group, schedule: Schedule, steps: int = 3) -> dict[str, object]:
    full = build_full_model(spec, seed=0, device="cpu")
    ref_opt = torch.optim.AdamW(full.parameters(), lr=1e-3)
    kw = dict(
        schedule=schedule, microbatches=schedule.microbatches, seed=0, device="cpu", timeout_s=60.0
    )
    pipe, debug = build_pipeline(spec, group=group, **kw), build_pipeline(spec, **kw)
    opts = [torch.optim.AdamW(q.parameters(), lr=1e-3) for q in (pipe, debug)]
    losses = []
    for step in range(steps):
        x, y = batch(100 + step)
        ref = token_cross_entropy(full(x), y) / (y != -100).sum()
        ref.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        got = [q.step(x, y).loss for q in (pipe, debug)]
        for q, opt in zip((pipe, debug), opts, strict=True):
            opt.step()
            q.zero_grad()
        losses.append((got[0], got[1], ref.item()))
    ref_params = dict(full.named_parameters())
    debug_modules = dict(zip(debug.stages, debug.modules, strict=True))
    worst, bitwise = 0.0, True
    for stage, module in zip(pipe.stages, pipe.modules, strict=True):
        twin = dict(debug_modules[stage].named_parameters(remove_duplicate=False))
        for name, q in module.named_parameters(remove_duplicate=False):
            worst = max(
                worst, float((q - ref_params[pipe.tied_names.get(name, name)]).abs().max().detach())
            )
            bitwise = bitwise and torch.equal(q, twin[name])
    # Forward only, after the updates: the loss of a held-out batch.
    x, y = batch(999)
    ref_eval = (token_cross_entropy(full(x), y) / (y != -100).sum()).item()
    evals = [q.eval_loss(x, y) for q in (pipe, debug)]
    return {
        "param_abs": worst,
        "params_bitwise": bitwise,
        "loss_rel": max(abs(a - r) / r for a, _, r in [*losses, (evals[0], evals[1], ref_eval)]),
        "loss_bitwise": all(a == b for a, b, _ in losses) and evals[0] == evals[1],
    }


def sequence_change_case(spec, group) -> dict[str, object]:
    """Sequence length 16, 16, 9, 24, 24: steps 2 and 5 find the shapes they guessed from the
    step before, steps 3 (shorter) and 4 (longer) do not (DistTransport's filler)."""
    pipe = build_pipeline(
        spec, schedule="zb-v", microbatches=4, group=group, seed=0, device="cpu", timeout_s=60.0
    )
    full = build_full_model(spec, seed=0, device="cpu")
    worst_loss, worst_grad = 0.0, 0.0
    for t in (16, 16, 9, 24, 24):
        x, y = batch(7, t=t)
        full.zero_grad()
        ref = token_cross_entropy(full(x), y) / (y != -100).sum()
        ref.backward()
        pipe.zero_grad()
        worst_loss = max(worst_loss, abs(pipe.step(x, y).loss - ref.item()) / ref.item())
        ref_grads = dict(full.named_parameters())
        for name, q in pipe.named_parameters():
            worst_grad = max(
                worst_grad, rel(q.grad, ref_grads[pipe.tied_names.get(name, name)].grad)
            )
    return {"loss_rel": worst_loss, "grad_rel": worst_grad}


@contextlib.contextmanager
def unpacked_messages() -> Iterator[None]:
    """No message travels packed (``wire_format.is_packable`` reads the limit when called)."""
    original = wire_format.PACK_LIMIT
    wire_format.PACK_LIMIT = 0
    try:
        yield
    finally:
        wire_format.PACK_LIMIT = original


@contextlib.contextmanager
def one_stream_transport() -> Iterator[None]:
    """Pipelines built inside use DistTransport(one_stream=True), as on NCCL."""
    original = wiring.DistTransport
    wiring.DistTransport = functools.partial(original, one_stream=True)
    try:
        yield
    finally:
        wiring.DistTransport = original


def run_equal(out: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = model_spec(get_model_config("llama-tiny", n_layers=6, tie_embeddings=True))
    results = one_step_cases(spec, dist.group.WORLD, world, out)
    if world == 2:
        results["sequence-change"] = sequence_change_case(spec, dist.group.WORLD)
        # The same with every message as header and payload (none packed): the filler of a
        # missed guess is then the posted tensors, not one buffer.
        with unpacked_messages():
            results["sequence-change-unpacked"] = sequence_change_case(spec, dist.group.WORLD)
        results["adamw-zb-h1"] = adamw_case(spec, dist.group.WORLD, build_schedule("zb-h1", 2, 4))
        results["adamw-chimera"] = adamw_case(
            spec, dist.group.WORLD, build_schedule("chimera", 2, 4)
        )
        # Tied embedding on both ranks (1f1b), on one rank twice (zb-v), replicas (chimera).
        for name in ("1f1b", "zb-v", "chimera"):
            results[f"accumulate-{name}"] = accumulation_case(
                spec, dist.group.WORLD, build_schedule(name, 2, 4)
            )
        # Orders that differ from program order on one side: the V turn, and loops of 2 and
        # 3 stages per rank; training and evaluation steps (different wire orders).
        for name, v in WIRE_SCHEDULES:
            schedule = build_schedule(name, 2, 4, chunks=v)
            results[f"wire-{name}-v{v}"] = adamw_case(spec, dist.group.WORLD, schedule, steps=2)
            # NCCL's discipline (both directions of a pair in one merged order) over gloo.
            with one_stream_transport():
                results[f"wire-one-stream-{name}-v{v}"] = adamw_case(
                    spec, dist.group.WORLD, schedule, steps=2
                )
    if world == 4:
        # Two independent 2-rank pipelines in one world: the runtime uses only its group.
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        mine = groups[rank // 2]
        results.update(one_step_cases(spec, mine, 2, out, prefix="pair-", names=PAIR_SCHEDULES))
    (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))


def run_kill(out: Path) -> None:
    rank = dist.get_rank()
    spec = model_spec(get_model_config("llama-tiny"))
    pipe = build_pipeline(
        spec,
        schedule="gpipe",
        microbatches=4,
        group=dist.group.WORLD,
        seed=0,
        timeout_s=120.0,
    )
    calls = []

    def die_in_step_1(module, inputs):
        calls.append(1)
        if rank == 1 and len(calls) == 4 + 3:  # the third forward of the second step
            (out / "killed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

    pipe.modules[0].register_forward_pre_hook(die_in_step_1)
    x, y = batch(0)
    for _ in range(3):
        pipe.step(x, y)


def run_stall(out: Path) -> None:
    """Rank 1 stops answering for 10 s in the middle of step 1; rank 0 gives up after 3 s."""
    del out
    rank = dist.get_rank()
    spec = model_spec(get_model_config("llama-tiny"))
    pipe = build_pipeline(
        spec, schedule="1f1b", microbatches=2, group=dist.group.WORLD, seed=0, timeout_s=3.0
    )
    calls = []

    def stall_in_step_1(module, inputs):
        calls.append(1)
        if rank == 1 and len(calls) == 2 + 1:  # the first forward of the second step
            time.sleep(10)

    pipe.modules[0].register_forward_pre_hook(stall_in_step_1)
    x, y = batch(0)
    for _ in range(2):
        pipe.step(x, y)


def main() -> int:
    mode, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        {"equal": run_equal, "kill": run_kill, "stall": run_stall}[mode](out)
    except PipelineError as exc:
        sys.stderr.write(f"rank {dist.get_rank()}: {exc}\n")
        return 1
    except Exception:
        traceback.print_exc()
        return 1
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_rank(main())  # not through finalization: gloo's threads can abort it (process_exit)
