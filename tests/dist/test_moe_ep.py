"""Mixture of experts with expert parallelism on four gloo processes (one launch) against
one process on the full batch.

pp=2 x dp=2 x ep=2 (1F1B; ZB-H1 with its split backward, a sigmoid router, a shared
expert and the loss-free bias; a capacity factor that drops tokens; a router that never
picks ep rank 1's experts, which then take part in every exchange with nothing to compute)
pp=1 x dp=2 x tp=2 x ep=2 (attention sharded, experts whole on each tp rank) and pp=1 x
dp=4 x ep=2 (each expert on two replicas). Every rank also trains the single-process reference
(all experts, 4 micro-batches of the same 2 sequences each) and compares per-step main
loss, auxiliary loss, dropped tokens and global gradient norm (clipping engaged) to 1e-5
relative over 5 AdamW steps, the balancing biases, and its final weights to 1e-4.
"""

from __future__ import annotations

import json
import textwrap

import pytest
from runtime_launch import launch

pytestmark = pytest.mark.dist

WORKER = textwrap.dedent(
    """
    import json, sys
    import torch
    import torch.distributed as dist
    from pipetrain.config import OptimConfig
    from pipetrain.models import get_model_config, model_spec
    from pipetrain.models.moe import moe_layers
    from torch.distributed.tensor import DTensor
    from pipetrain.parallel.tp import shard_stage
    from pipetrain.parallel import (
        ExpertGradients, Gradients, ReplicaGradients, build_mesh, expert_groups,
        expert_parameters, norm_share, replica_denominator, replica_mean, shard_batch,
        shard_experts,
    )
    from pipetrain.runtime import PipelineHooks, build_pipeline
    from pipetrain.train.data import Batch
    from pipetrain.train.experts import ExpertTracker
    from pipetrain.train.optim import GuardedUpdate, build_optimizer
    from pipetrain.train.plan import block_split
    from pipetrain.train.session import local_gradients

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    optim = OptimConfig(lr=1e-2, warmup_steps=1, grad_clip=0.5)
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 256, (8, 17), generator=gen) for _ in range(5)]
    batches = [Batch(t[:, :-1], t[:, 1:]) for t in ids]
    STEPS = 5
    CPU = torch.device("cpu")

    def biases(modules):
        return {n: l.expert_bias.tolist() for m in modules for n, l in moe_layers(m)
                if l.expert_bias is not None}

    def full(p):
        return (p.full_tensor() if isinstance(p, DTensor) else p).detach()

    def idle(modules, on):
        # Experts 2 and 3 (ep rank 1's) never chosen: that rank gets no token at all.
        for m in modules:
            for _, layer in moe_layers(m):
                if on:
                    layer.expert_bias[2:] = -10.0

    def reference(config, idle_experts=False):
        spec = model_spec(config)
        pipe = build_pipeline(spec, schedule="1f1b", microbatches=4, ranks=1, device="cpu",
                              split=block_split(config.n_layers, 1))
        idle(pipe.modules, idle_experts)
        opt = build_optimizer(pipe.named_parameters(), optim)
        update = GuardedUpdate(opt, optim, total_steps=STEPS, group=None)
        grads = Gradients.of(list(pipe.parameters()))
        tracker = ExpertTracker(config, pipe.modules, None, CPU)
        rows = []
        for step in range(STEPS):
            loss = pipe.step(batches[step].inputs, batches[step].targets).loss
            moe = tracker.collect()
            o = update.apply(step, grads, loss)
            tracker.update_bias(moe)
            rows.append([loss, moe.aux_loss, moe.dropped, o.grad_norm, o.clip_factor])
        params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        return rows, params, biases(pipe.modules)

    def parallel(mesh, config, schedule, ep=2, idle_experts=False):
        ref_rows, ref_params, ref_bias = reference(config, idle_experts)
        groups = expert_groups(mesh, ep)
        replicas = ReplicaGradients(mesh, timeout_s=60, experts=ExpertGradients(groups, mesh.dp))
        pipe = build_pipeline(
            model_spec(config, expert_shard=(groups.ep_rank, ep)), schedule=schedule,
            microbatches=4 // mesh.dp, group=mesh.pp_group if mesh.pp > 1 else None,
            ranks=None if mesh.pp > 1 else 1, device="cpu", timeout_s=60,
            split=block_split(config.n_layers, mesh.pp),
            hooks=PipelineHooks(grads_hook=replicas.grads_hook),
        )
        shard_experts(pipe.modules, groups)
        idle(pipe.modules, idle_experts)
        if mesh.tp > 1:  # attention sharded over tp; the router and experts stay whole
            for module in pipe.modules:
                shard_stage(module, mesh.tp_mesh)
            pipe.rebind_parameters()
        replicas.attach(pipe)
        opt = build_optimizer(pipe.named_parameters(), optim)
        update = GuardedUpdate(opt, optim, total_steps=STEPS, group=mesh.world_group)
        routed = expert_parameters(pipe.modules)
        grads = norm_share(local_gradients(pipe), mesh,
                           experts=(routed, groups.replica_index == 0))
        tracker = ExpertTracker(config, pipe.modules, mesh, CPU, group=groups.group)
        rows = []
        for step in range(STEPS):
            shard = shard_batch(batches[step], mesh.dp_rank, mesh.dp)
            replicas.begin(sync=True)
            loss = pipe.step(shard.inputs, shard.targets,
                             denominator=replica_denominator(batches[step].targets, mesh.dp)).loss
            replicas.finish(step)
            loss = replica_mean([loss], mesh, CPU)[0]
            moe = tracker.collect()
            o = update.apply(step, grads, loss)
            tracker.update_bias(moe)
            rows.append([loss, moe.aux_loss, moe.dropped, o.grad_norm, o.clip_factor])
        errors = {n: float((full(p) - ref_params[n]).norm() / ref_params[n].norm())
                  for n, p in pipe.named_parameters()}
        mine = biases(pipe.modules)
        return {"rows": rows, "ref_rows": ref_rows, "weight_errors": errors,
                "experts_here": len(routed) // 3, "bias": mine,
                "ref_bias": {n: ref_bias[n] for n in mine}}

    base = dict(aux_loss_coef=0.1)
    cases = {}
    mesh = build_mesh("cpu", 2, 2)
    cases["1f1b"] = parallel(mesh, get_model_config("moe-tiny", **base), "1f1b")
    cases["zb-h1-sigmoid-shared-bias"] = parallel(mesh, get_model_config(
        "moe-tiny", router="sigmoid", n_shared_experts=1, bias_update_rate=0.01, **base), "zb-h1")
    cases["capacity"] = parallel(mesh, get_model_config(
        "moe-tiny", capacity_factor=1.0, **base), "1f1b")
    cases["idle-rank"] = parallel(mesh, get_model_config(
        "moe-tiny", bias_update_rate=1e-6, **base), "zb-h1", idle_experts=True)
    cases["dp2-tp2-ep2"] = parallel(build_mesh("cpu", 1, 2, 2), get_model_config(
        "moe-tiny", **base), "1f1b")
    cases["pp1-dp4-ep2"] = parallel(build_mesh("cpu", 1, 4), get_model_config(
        "moe-tiny", bias_update_rate=0.01, **base), "1f1b")
    with open(sys.argv[1] + f"/rank{dist.get_rank()}.json", "w") as f:
        json.dump(cases, f)
    dist.destroy_process_group()
    from pipetrain.launch import exit_rank

    exit_rank(0)
    """
)

CASES = [
    "1f1b", "zb-h1-sigmoid-shared-bias", "capacity", "idle-rank", "dp2-tp2-ep2", "pp1-dp4-ep2",
]  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("ep")
    script = tmp / "worker.py"
    script.write_text(WORKER)
    run = launch(4, [str(tmp)], timeout_s=280.0, worker=script)
    assert run.returncodes == (0, 0, 0, 0), "\n".join(e[-3000:] for e in run.stderr)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.parametrize("case", CASES)
def test_equals_one_process_on_the_full_batch(results: list[dict], case: str) -> None:
    for out in results:
        got = out[case]
        rows, ref = got["rows"], got["ref_rows"]
        assert len(rows) == len(ref) == 5
        for step, (row, ref_row) in enumerate(zip(rows, ref, strict=True)):
            loss, aux, dropped, norm, clip = row
            ref_loss, ref_aux, ref_dropped, ref_norm, ref_clip = ref_row
            assert loss == pytest.approx(ref_loss, rel=1e-5), (case, step)
            assert aux == pytest.approx(ref_aux, rel=1e-5), (case, step)
            assert dropped == ref_dropped, (case, step)
            assert norm == pytest.approx(ref_norm, rel=1e-5), (case, step)
            assert clip == pytest.approx(ref_clip, rel=1e-5), (case, step)
        assert min(r[4] for r in rows) < 1.0, "clipping never engaged: a bad norm would pass"
        # Each rank holds half of the experts of each of its MoE layers (4 experts, ep=2).
        layers = 2 if case not in ("pp1-dp4-ep2", "dp2-tp2-ep2") else 4
        assert got["experts_here"] == 2 * layers
        assert max(got["weight_errors"].values()) < 1e-4, got["weight_errors"]
        for name, bias in got["bias"].items():
            assert bias == pytest.approx(got["ref_bias"][name], abs=1e-7), name


def test_the_cases_exercise_what_they_name(results: list[dict]) -> None:
    out = results[0]
    assert all(r[2] > 0 for r in out["capacity"]["rows"]), "capacity 1.0 should drop tokens"
    assert all(r[2] == 0 for r in out["1f1b"]["rows"]), "dropless routing dropped tokens"
    assert all(r[1] > 0.5 for r in out["1f1b"]["rows"])  # about 1 per layer when balanced
    biased = out["zb-h1-sigmoid-shared-bias"]["bias"]
    assert biased and any(any(v != 0 for v in b) for b in biased.values()), "bias never moved"
