"""One rank of the runtime's multi-process checks (started by tests/dist/launch.py).

``runtime_worker.py equal OUT``: every synchronous schedule for this world size, one step
each on llama-tiny, compared with one process on the whole batch (loss and every
gradient to 1e-5 relative) and with the debug mode (bit for bit); AdamW steps; a user CSV
schedule; with 4 ranks also two 2-rank pipelines side by side. Writes OUT/rank<r>.json.

``runtime_worker.py kill OUT``: rank 1 kills itself in the middle of step 1; the others
must fail with an error naming it (printed to stderr, exit status 1).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from pipetrain.models import build_full_model, get_model_config, model_spec
from pipetrain.runtime import PipelineError, build_pipeline
from pipetrain.runtime.stage import token_cross_entropy
from pipetrain.schedules import (
    Action,
    Kind,
    Placement,
    Schedule,
    dualpipe,
    gpipe,
    interleaved,
    naive,
    one_f_one_b,
    zero_bubble,
)

RTOL = 1e-5


def chimera_p2() -> Schedule:
    a = Action
    ranks = [
        [
            a(0, Kind.F, 0),
            a(3, Kind.F, 1),
            a(3, Kind.B, 1),
            a(0, Kind.B, 0),
            a(0, Kind.ALLREDUCE),
            a(3, Kind.ALLREDUCE),
        ],
        [
            a(2, Kind.F, 1),
            a(1, Kind.F, 0),
            a(1, Kind.B, 0),
            a(2, Kind.B, 1),
            a(2, Kind.ALLREDUCE),
            a(1, Kind.ALLREDUCE),
        ],
    ]
    return Schedule.build("chimera", Placement.bidirectional(2), 2, ranks)


def schedules(p: int) -> dict[str, Callable[[], Schedule]]:
    cases: dict[str, Callable[[], Schedule]] = {
        "naive": lambda: naive.naive(p, 1),
        "gpipe": lambda: gpipe.gpipe(p, 4),
        "1f1b": lambda: one_f_one_b.one_f_one_b(p, 4),
        "interleaved-1f1b": lambda: interleaved.interleaved_1f1b(p, 4),
        "looped-bfs": lambda: interleaved.looped_bfs(p, 4),
        "zb-h1": lambda: zero_bubble.zb_h1(p, 4),
        "zb-h2": lambda: zero_bubble.zb_h2(p, 2 * p),  # needs m >= 2p - 1
        "zb-v": lambda: zero_bubble.zb_v(p, 4),
        "dualpipe-v": lambda: dualpipe.dualpipe_v(p, 2 * p),
    }
    if p == 2:
        cases["chimera"] = chimera_p2
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


def one_step_cases(spec, group, p: int, prefix: str = "") -> dict[str, dict[str, object]]:
    x, y = batch(0)
    full = build_full_model(spec, seed=0, device="cpu")
    ref_loss = token_cross_entropy(full(x), y) / (y != -100).sum()
    ref_loss.backward()
    ref_grads = {n: q.grad for n, q in full.named_parameters()}
    results: dict[str, dict[str, object]] = {}
    for name, make in schedules(p).items():
        schedule = make()
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
            worst = max(worst, float((q - ref_params[pipe.tied_names.get(name, name)]).abs().max()))
            bitwise = bitwise and torch.equal(q, twin[name])
    return {
        "param_abs": worst,
        "params_bitwise": bitwise,
        "loss_rel": max(abs(a - r) / r for a, _, r in losses),
        "loss_bitwise": all(a == b for a, b, _ in losses),
    }


def run_equal(out: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = model_spec(get_model_config("llama-tiny", n_layers=6, tie_embeddings=True))
    results = one_step_cases(spec, dist.group.WORLD, world)
    if world == 2:
        results["adamw-zb-h1"] = adamw_case(spec, dist.group.WORLD, zero_bubble.zb_h1(2, 4))
        results["adamw-chimera"] = adamw_case(spec, dist.group.WORLD, chimera_p2())
    if world == 4:
        # Two independent 2-rank pipelines in one world: the runtime uses only its group.
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        mine = groups[rank // 2]
        results.update(one_step_cases(spec, mine, 2, prefix="pair-"))
    (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))


def run_kill(out: Path) -> None:
    del out
    rank = dist.get_rank()
    spec = model_spec(get_model_config("llama-tiny"))
    pipe = build_pipeline(
        spec,
        schedule=gpipe.gpipe(3, 4),
        microbatches=4,
        group=dist.group.WORLD,
        seed=0,
        timeout_s=120.0,
    )
    calls = []

    def die_in_step_1(module, inputs):
        calls.append(1)
        if rank == 1 and len(calls) == 4 + 3:  # the third forward of the second step
            os.kill(os.getpid(), signal.SIGKILL)

    pipe.modules[0].register_forward_pre_hook(die_in_step_1)
    x, y = batch(0)
    for _ in range(3):
        pipe.step(x, y)


def main() -> int:
    mode, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        {"equal": run_equal, "kill": run_kill}[mode](out)
    except PipelineError as exc:
        sys.stderr.write(f"rank {dist.get_rank()}: {exc}\n")
        return 1
    except Exception:
        traceback.print_exc()
        return 1
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
