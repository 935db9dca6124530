"""pp=2 x dp=2 on four gloo processes (one launch) against one process on the full batch.

Every rank also trains the single-process reference itself (the tiny model costs little),
so each one compares its own stage: per-step losses, gradient norms and final weights to
1e-5 relative over 5 AdamW steps with clipping engaged, for 1F1B and ZB-H1, plus gradient
accumulation, the (pp, dp) mesh layout, the all-reduce starting inside the pipeline step,
and a NaN on one rank making all four skip. With the gradients as views of the buckets
(``grad_views``), the same cases equal the copying runs bit for bit.
"""

from __future__ import annotations

import json
import textwrap

import pytest
from runtime_launch import launch

pytestmark = pytest.mark.dist

WORKER = textwrap.dedent(
    """
    import json, math, sys
    import torch
    import torch.distributed as dist
    from pipetrain.models import get_model_config, model_spec
    from pipetrain.runtime import PipelineHooks, build_pipeline
    from pipetrain.config.schema import OptimConfig
    from pipetrain.data import Batch
    from pipetrain.train.optim import Gradients, GuardedUpdate, build_optimizer
    from pipetrain.parallel import (
        ReplicaGradients, build_mesh, norm_share, replica_mean, shard_batch,
    )
    from pipetrain.train.plan import block_split

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = build_mesh("cpu", 2, 2)
    out = {
        "pp_rank": mesh.pp_rank,
        "dp_rank": mesh.dp_rank,
        "pp_members": dist.get_process_group_ranks(mesh.pp_group),
        "dp_members": dist.get_process_group_ranks(mesh.dp_group),
    }
    config = get_model_config("llama-tiny")
    spec = model_spec(config)
    # A small clip so that it engages: the norm must be the one of the whole model.
    optim = OptimConfig(lr=1e-2, warmup_steps=1, grad_clip=0.5)
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 256, (8, 17), generator=gen) for _ in range(10)]
    batches = [Batch(t[:, :-1], t[:, 1:]) for t in ids]
    STEPS = 5

    def reference(accum):
        pipe = build_pipeline(spec, schedule="1f1b", microbatches=4, ranks=1, device="cpu",
                              split=block_split(config.n_layers, 1))
        opt = build_optimizer(pipe.named_parameters(), optim)
        update = GuardedUpdate(opt, optim, total_steps=STEPS, group=None)
        grads = Gradients.of(list(pipe.parameters()))
        rows = []
        for step in range(STEPS):
            losses = [pipe.step(b.inputs, b.targets).loss
                      for b in batches[step * accum:(step + 1) * accum]]
            loss = sum(losses) / len(losses)
            o = update.apply(step, grads, loss, accumulated=accum)
            rows.append([loss, o.grad_norm, o.clip_factor])
        return rows, {n: p.detach().clone() for n, p in pipe.named_parameters()}

    def data_parallel(schedule, accum, chunks, views=False):
        replicas = ReplicaGradients(mesh, timeout_s=60, bucket_bytes=20_000, grad_views=views)
        pipe = build_pipeline(spec, schedule=schedule, microbatches=2, group=mesh.pp_group,
                              chunks=chunks, device="cpu", timeout_s=60,
                              split=block_split(config.n_layers, 2 * (chunks or 1)),
                              hooks=PipelineHooks(grads_hook=replicas.grads_hook))
        replicas.attach(pipe)
        opt = build_optimizer(pipe.named_parameters(), optim)
        update = GuardedUpdate(opt, optim, total_steps=STEPS, group=mesh.world_group)
        grads = norm_share(Gradients.of(list(pipe.parameters())), mesh)
        rows, early, viewed = [], [], []
        for step in range(STEPS):
            losses = []
            for micro in range(accum):
                shard = shard_batch(batches[step * accum + micro], mesh.dp_rank, mesh.dp)
                replicas.begin(sync=micro == accum - 1)
                losses.append(pipe.step(shard.inputs, shard.targets).loss)
            replicas.finish(step)
            early.append(list(replicas.launched_in_step))
            viewed.append(all(replicas._viewed(b) is not None for b in replicas._all_buckets()))
            loss = replica_mean([sum(losses) / len(losses)], mesh, torch.device("cpu"))[0]
            o = update.apply(step, grads, loss, accumulated=accum)
            rows.append([loss, o.grad_norm, o.clip_factor])
        return pipe, replicas, update, grads, rows, early, viewed

    def rel(a, b):
        return float((a - b).norm() / b.norm().clamp_min(1e-12))

    cases, copied = {}, {}
    for name, schedule, accum, chunks, views in (
        ("1f1b", "1f1b", 1, None, False),
        ("zb-h1", "zb-h1", 1, None, False),
        ("1f1b-accum2", "1f1b", 2, None, False),
        # Two stages per rank: each stage's all-reduce starts after its own last B.
        ("interleaved", "interleaved-1f1b", 1, 2, False),
        # The same with .grad as views of the buckets: W and accumulation add in place.
        ("zb-h1-views", "zb-h1", 1, None, True),
        ("1f1b-accum2-views", "1f1b", 2, None, True),
        ("interleaved-views", "interleaved-1f1b", 1, 2, True),
    ):
        ref_rows, ref_params = reference(accum)
        pipe, replicas, update, grads, rows, early, viewed = data_parallel(
            schedule, accum, chunks, views
        )
        params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        twin = copied.get(name.removesuffix("-views")) if views else None
        copied[name] = params
        cases[name] = {
            "rows": rows,
            "ref_rows": ref_rows,
            "weight_errors": {n: rel(p, ref_params[n]) for n, p in params.items()},
            "early": early,
            "viewed": viewed,
            "bitwise_as_copies": None if twin is None else (
                all(torch.equal(p, twin[n]) for n, p in params.items())
            ),
            "stages": list(pipe.stages),
            "buckets": len(replicas._stage_buckets[pipe.stages[0]]),
            "bytes": replicas.bytes_per_step,
        }
    out["cases"] = cases

    # A NaN weight on rank 3 only (a last stage of replica 1): its loss and gradients go bad,
    # its dp partner gets them through the average, the other pipeline through the
    # world-wide check; every rank skips and nobody's weights move.
    if dist.get_rank() == 3:
        with torch.no_grad():
            next(iter(pipe.parameters())).view(-1)[0] = math.nan
    before = [p.detach().clone() for p in pipe.parameters()]
    shard = shard_batch(batches[0], mesh.dp_rank, mesh.dp)
    replicas.begin(sync=True)
    step_loss = pipe.step(shard.inputs, shard.targets).loss
    replicas.finish(STEPS)
    loss = replica_mean([step_loss], mesh, torch.device("cpu"))[0]
    o = update.apply(STEPS, grads, loss)
    out["nan_skipped"] = o.skipped
    out["nan_moved"] = any(
        not torch.allclose(a, p.detach(), rtol=0, atol=0, equal_nan=True)
        for a, p in zip(before, pipe.parameters())
    )
    with open(sys.argv[1] + f"/rank{dist.get_rank()}.json", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
    # Not through finalization: gloo's threads can abort it (pipetrain.launch.process_exit).
    from pipetrain.launch.process_exit import exit_rank

    exit_rank(0)
    """
)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("dp")
    script = tmp / "worker.py"
    script.write_text(WORKER)
    run = launch(4, [str(tmp)], timeout_s=280.0, worker=script)
    assert run.returncodes == (0, 0, 0, 0), "\n".join(e[-2000:] for e in run.stderr)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(4)]


def test_mesh_is_pp_by_dp(results: list[dict]) -> None:
    for rank, out in enumerate(results):
        assert (out["pp_rank"], out["dp_rank"]) == divmod(rank, 2)
        assert out["pp_members"] == [rank % 2, rank % 2 + 2]  # a pipeline: one rank per pp row
        assert out["dp_members"] == [rank - rank % 2, rank - rank % 2 + 1]


@pytest.mark.parametrize(
    "case",
    [
        "1f1b", "zb-h1", "1f1b-accum2", "interleaved",
        "zb-h1-views", "1f1b-accum2-views", "interleaved-views",
    ],
)  # fmt: skip
def test_equals_one_process_on_the_full_batch(results: list[dict], case: str) -> None:
    for out in results:
        got = out["cases"][case]
        rows, ref = got["rows"], got["ref_rows"]
        assert len(rows) == len(ref) == 5
        for step, ((loss, norm, clip), (ref_loss, ref_norm, ref_clip)) in enumerate(
            zip(rows, ref, strict=True)
        ):
            assert loss == pytest.approx(ref_loss, rel=1e-5), (case, step)
            assert norm == pytest.approx(ref_norm, rel=1e-5), (case, step)
            assert clip == pytest.approx(ref_clip, rel=1e-5), (case, step)
        assert min(r[2] for r in rows) < 1.0, (
            "clipping never engaged: the test would miss a bad norm"
        )
        assert got["weight_errors"], "no parameters compared"
        assert max(got["weight_errors"].values()) < 1e-5, got["weight_errors"]


def test_allreduce_starts_inside_the_step_in_buckets(results: list[dict]) -> None:
    for out in results:
        for case, got in out["cases"].items():
            # Every step's all-reduce of this rank's stages began right after their last B/W.
            assert [sorted(e) for e in got["early"]] == [got["stages"]] * 5, case
            # 20 kB buckets split a stage's gradients (~107 kB; ~53 kB with two per rank).
            assert got["buckets"] > 1
            assert got["bytes"] > 0
        # In the order the stages finish their backward: a rank's later chunk first, except
        # where early input gradients moved a W to the end of the rank (interleaved 1F1B,
        # p = 2, m = 2: rank 1 runs 1F0 1F1 3F0 3B0 3F1 3I1 1B0 1B1 3W1, so stage 3 last).
        interleaved = out["cases"]["interleaved"]
        stages = interleaved["stages"]
        assert interleaved["early"][0] == (stages[::-1] if out["pp_rank"] == 0 else stages)


@pytest.mark.parametrize("case", ["zb-h1", "1f1b-accum2", "interleaved"])
def test_grads_as_bucket_views_match_the_copies_bit_for_bit(results: list[dict], case: str) -> None:
    for out in results:
        views, copies = out["cases"][case + "-views"], out["cases"][case]
        assert views["viewed"] == [True] * 5  # every .grad lay in its bucket at each finish
        assert copies["viewed"] == [False] * 5
        assert views["rows"] == copies["rows"]
        assert views["bitwise_as_copies"] is True


def test_a_nan_on_one_rank_makes_every_rank_skip(results: list[dict]) -> None:
    assert [out["nan_skipped"] for out in results] == [True] * 4
    assert [out["nan_moved"] for out in results] == [False] * 4
