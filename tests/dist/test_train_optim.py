"""Global clipping and the NaN guard across two gloo processes (one torchrun launch).

Each rank holds half of a small model's parameters, as two pipeline stages would, plus a
copy of one "tied" weight that both hold. The global norm, the clip factor and the
skip decision must be the same on both ranks and equal to one process on the whole model;
then the same through a real 2-stage pipeline of gpt2-tiny, whose tied embedding spans ranks.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from runtime_launch import torchrun

pytestmark = pytest.mark.dist

WORKER = textwrap.dedent(
    """
    import json, math, sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from pipetrain.config.schema import OptimConfig
    from pipetrain.train.optim import Gradients, GuardedUpdate, TrainingDiverged, check_gradients

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = {}

    def model_with_grads():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(13, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 13))
        model(torch.arange(12) % 13).pow(2).sum().backward()
        return model

    full = model_with_grads()
    params = list(full.parameters())
    # The reference: one process, whole model.
    reference = model_with_grads()
    ref_norm = float(nn.utils.clip_grad_norm_(reference.parameters(), 0.25))
    with torch.no_grad():
        for p in reference.parameters():
            p -= p.grad  # SGD with lr 1 on the clipped gradient

    # This rank's "stage": every other parameter, plus a tied copy of parameter 0 on rank 1.
    mine = [p for i, p in enumerate(params) if i % 2 == rank]
    tied_copy = None
    if rank == 1:
        tied_copy = nn.Parameter(params[0].detach().clone())
        tied_copy.grad = params[0].grad.clone()
        mine.append(tied_copy)
    grads = Gradients.of(mine, not_counted=[tied_copy] if tied_copy is not None else [])
    out["local_norm"] = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in grads.counted])))
    out["ref_norm"] = ref_norm
    out["global_norm"] = check_gradients(grads, 1.0, dist.group.WORLD).norm

    config = OptimConfig(lr=1.0, warmup_steps=0, grad_clip=0.25, max_bad_steps=2)
    update = GuardedUpdate(torch.optim.SGD(mine, lr=1.0), config, total_steps=10, group=dist.group.WORLD)
    outcome = update.apply(0, grads, 1.0)
    out["clip_factor"] = outcome.clip_factor
    out["max_param_error"] = max(
        float((p.detach() - r.detach()).abs().max())
        for i, (p, r) in enumerate(zip(params, reference.parameters()))
        if i % 2 == rank
    )
    if tied_copy is not None:
        out["tied_error"] = float((tied_copy.detach() - list(reference.parameters())[0].detach()).abs().max())

    # A NaN in one gradient on rank 1 only: both ranks skip, nobody's weights move.
    for p in mine:
        p.grad = torch.ones_like(p)
    if rank == 1:
        mine[0].grad[0] = math.nan
    before = [p.detach().clone() for p in mine]
    skipped = update.apply(1, grads, 1.0)
    out["skipped"] = skipped.skipped
    out["unchanged"] = all(torch.equal(a, p.detach()) for a, p in zip(before, mine))

    # A second bad step in a row stops the run on both ranks, with the loss NaN on rank 0 only.
    for p in mine:
        p.grad = torch.ones_like(p)
    try:
        update.apply(2, grads, math.nan if rank == 0 else 1.0)
        out["stopped"] = ""
    except TrainingDiverged as exc:
        out["stopped"] = str(exc)

    # The same through a real pipeline: gpt2-tiny (embedding tied to the head, which sit
    # on different ranks), one 1F1B step. The norm must be one process's on the whole model.
    from pipetrain.models import build_full_model, get_model_config, model_spec
    from pipetrain.runtime import build_pipeline
    from pipetrain.train.session import local_gradients as _gradients
    from pipetrain.train.plan import block_split

    spec = model_spec(get_model_config("gpt2-tiny"))
    pipe = build_pipeline(spec, schedule="1f1b", microbatches=2, group=dist.group.WORLD,
                          device="cpu", seed=3, split=block_split(3, 2))
    ids = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(5))
    result = pipe.step(ids[:, :-1], ids[:, 1:])
    pipe_grads = _gradients(pipe)
    out["pipe_norm"] = check_gradients(pipe_grads, result.loss, dist.group.WORLD).norm
    full_model = build_full_model(spec, seed=3, device="cpu")
    logits = full_model(ids[:, :-1])
    full_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1))
    full_loss.backward()
    out["full_norm"] = float(nn.utils.clip_grad_norm_(full_model.parameters(), 1e9))
    out["tied_copies_here"] = len(pipe_grads.all) - len(pipe_grads.counted)
    # A NaN in one gradient of rank 1's stage: every rank skips, no weight moves.
    if rank == 1:
        next(iter(pipe.parameters())).grad.view(-1)[0] = math.nan
    pipe_update = GuardedUpdate(
        torch.optim.AdamW(pipe.parameters(), lr=1e-3), config, total_steps=10, group=dist.group.WORLD
    )
    before = [p.detach().clone() for p in pipe.parameters()]
    out["pipe_skipped"] = pipe_update.apply(0, pipe_grads, result.loss).skipped
    out["pipe_unchanged"] = all(torch.equal(a, p.detach()) for a, p in zip(before, pipe.parameters()))

    with open(sys.argv[1] + f".{rank}", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
    # Not through finalization: gloo's threads can abort it (pipetrain.launch.process_exit).
    from pipetrain.launch.process_exit import exit_rank

    exit_rank(0)
    """
)


def test_global_clip_and_nan_skip_agree_across_ranks(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    result_base = tmp_path / "result"
    returncode, stderr = torchrun(script, 2, [str(result_base)])
    assert returncode == 0, stderr[-3000:]
    results = [json.loads(Path(f"{result_base}.{rank}").read_text()) for rank in range(2)]
    for out in results:
        assert out["global_norm"] == pytest.approx(out["ref_norm"], rel=1e-6)
        # The trap: a rank's own norm is not the global one.
        assert out["local_norm"] < out["ref_norm"] * 0.999
        assert out["clip_factor"] == pytest.approx(0.25 / out["ref_norm"], rel=1e-5)
        assert out["max_param_error"] < 1e-6
        assert out["skipped"] is True and out["unchanged"] is True
        assert "step 3: loss or gradients were not finite for 2 steps in a row" in out["stopped"]
    assert results[0]["clip_factor"] == results[1]["clip_factor"]
    assert results[1]["tied_error"] < 1e-6
    for out in results:
        assert out["pipe_norm"] == pytest.approx(out["full_norm"], rel=1e-5)
        assert out["pipe_skipped"] is True and out["pipe_unchanged"] is True
    # The head's copy of the tied embedding (rank 1) is stepped but not counted.
    assert [out["tied_copies_here"] for out in results] == [0, 1]
