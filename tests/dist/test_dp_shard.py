"""pp=2 x dp=2 with sharded stages (FSDP2, --shard) on four gloo processes, one launch.

Every rank trains the single-process reference on the full batch itself and compares its
own stage: per-step losses, gradient norms, clip factors and final weights to 1e-5
relative over 5 AdamW steps with clipping engaged, for 1F1B and ZB-H1 (whose W adds
weight gradients after autograd's backward: the reduce-scatter must wait for it),
gradient accumulation, two stages per rank, and tied embeddings summed across pipeline
ranks. Replicas with unequal numbers of ignored target tokens (DDP and sharded) must
still give the full batch's gradient. Evaluation and gather_state_dict work on sharded
stages, and checkpoints move between sharded pp=2 x dp=2, DDP pp=2 x dp=2 and pp=4.
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
    from torch.distributed.tensor import DTensor
    from pipetrain.checkpoint import load_checkpoint, save_checkpoint
    from pipetrain.models import get_model_config, model_spec
    from pipetrain.runtime import PipelineHooks, build_pipeline
    from pipetrain.config.schema import OptimConfig
    from pipetrain.data import Batch
    from pipetrain.train.optim import Gradients, GuardedUpdate, build_optimizer
    from pipetrain.parallel import (
        ReplicaGradients, build_mesh, norm_share, replica_denominator, replica_mean,
        shard_batch, state_bytes,
    )
    from pipetrain.train.plan import block_split
    from pipetrain.train.sample import gather_state_dict
    from pipetrain.parallel.sharded import ShardedGradients

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    # FSDP2 all-gathers through dist.all_gather_single (torch 2.13; all_gather_into_tensor
    # in earlier releases): count them inside pipeline steps.
    GATHERS = [0]
    GATHER_NAME = (
        "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    )
    _all_gather = getattr(dist, GATHER_NAME)

    def counting_all_gather(*args, **kwargs):
        GATHERS[0] += 1
        return _all_gather(*args, **kwargs)

    setattr(dist, GATHER_NAME, counting_all_gather)
    mesh = build_mesh("cpu", 2, 2)
    world = dist.group.WORLD
    cpu = torch.device("cpu")
    optim = OptimConfig(lr=1e-2, warmup_steps=1, grad_clip=0.5)
    STEPS = 5
    MODELS = {
        "llama": get_model_config("llama-tiny"),
        # Tied embeddings (the head on pp rank 1 reuses pp rank 0's embedding) and biases.
        "gpt2": get_model_config("gpt2-tiny"),
    }

    def make_batches(ignored):
        gen = torch.Generator().manual_seed(0)
        out = []
        for i in range(10):
            t = torch.randint(0, 256, (8, 17), generator=gen)
            targets = t[:, 1:].clone()
            if ignored:
                # Replica 0 (rows 0-3) loses 3 + i % 4 positions of one row, replica 1 (rows
                # 4-7) 12 in each of two rows: very different token counts per replica.
                targets[1, : 3 + i % 4] = -100
                targets[5:7, 4:] = -100
            out.append(Batch(t[:, :-1], targets))
        return out

    PLAIN, IGNORED = make_batches(False), make_batches(True)

    def reference(model, batches, accum, steps=STEPS):
        spec = model_spec(MODELS[model])
        pipe = build_pipeline(spec, schedule="1f1b", microbatches=4, ranks=1, device="cpu",
                              split=block_split(MODELS[model].n_layers, 1))
        opt = build_optimizer(pipe.named_parameters(), optim)
        update = GuardedUpdate(opt, optim, total_steps=STEPS, group=None)
        grads = Gradients.of(list(pipe.parameters()), not_counted=[
            p for n, p in pipe.named_parameters() if n in pipe.tied_names])
        rows = []
        for step in range(steps):
            losses = [pipe.step(b.inputs, b.targets).loss
                      for b in batches[step * accum:(step + 1) * accum]]
            loss = sum(losses) / len(losses)
            o = update.apply(step, grads, loss, accumulated=accum)
            rows.append([loss, o.grad_norm, o.clip_factor])
        evals = pipe.eval_loss(batches[-1].inputs, batches[-1].targets)
        return rows, {n: p.detach().clone() for n, p in pipe.named_parameters()}, evals

    class Run:
        # One pipeline of pp=2 x dp=2 (DDP or sharded) or pp=4, its optimizer and update.
        def __init__(self, model, schedule, mode, chunks=None, layout=(2, 2)):
            config = MODELS[model]
            self.spec = model_spec(config)
            self.layout = layout
            pp, dp = layout
            group = mesh.pp_group if dp > 1 else world
            self.dp = None
            if dp > 1:
                self.dp = (ShardedGradients(mesh, timeout_s=60) if mode == "shard"
                           else ReplicaGradients(mesh, timeout_s=60))
            stages = pp * (chunks or 1)
            self.pipe = build_pipeline(
                self.spec, schedule=schedule, microbatches=2 if dp > 1 else 4, group=group,
                chunks=chunks,
                device="cpu", timeout_s=60,
                split=block_split(config.n_layers, stages),
                hooks=PipelineHooks(
                    grads_hook=self.dp.grads_hook if self.dp is not None else None))
            if self.dp is not None:
                self.dp.attach(self.pipe)
            self.opt = build_optimizer(self.pipe.named_parameters(), optim)
            self.update = GuardedUpdate(self.opt, optim, total_steps=STEPS, group=world)
            grads = Gradients.of(list(self.pipe.parameters()), not_counted=[
                p for n, p in self.pipe.named_parameters() if n in self.pipe.tied_names])
            self.grads = grads if dp == 1 else norm_share(grads, mesh, sharded=mode == "shard")
            self.model = model
            self.gathers, self.early, self.prefetched = [], [], []

        def step(self, step, batches, accum=1):
            losses = []
            GATHERS[0] = 0
            for micro in range(accum):
                batch = batches[step * accum + micro]
                if self.dp is None:
                    losses.append(self.pipe.step(batch.inputs, batch.targets).loss)
                    continue
                shard = shard_batch(batch, mesh.dp_rank, mesh.dp)
                self.dp.begin(sync=micro == accum - 1)
                if micro == 0:
                    # Sharded: the gathers are issued by begin, before any forward runs.
                    self.prefetched.append(GATHERS[0])
                losses.append(self.pipe.step(
                    shard.inputs, shard.targets,
                    denominator=replica_denominator(batch.targets, mesh.dp)).loss)
            loss = sum(losses) / len(losses)
            self.gathers.append(GATHERS[0])
            if self.dp is not None:
                self.dp.finish(step)
                self.early.append(sorted(self.dp.launched_in_step))
                loss = replica_mean([loss], mesh, cpu)[0]
            o = self.update.apply(step, self.grads, loss, accumulated=accum)
            self.skipped = o.skipped
            return [loss, o.grad_norm, o.clip_factor]

        def weights(self):
            # Full tensors (a collective over the dp group for sharded ones).
            out = {}
            for n, p in self.pipe.named_parameters():
                t = p.full_tensor() if isinstance(p, DTensor) else p
                out[n] = t.detach().clone()
            return out

        def eval_loss(self, batch):
            if self.dp is None:
                return self.pipe.eval_loss(batch.inputs, batch.targets)
            shard = shard_batch(batch, mesh.dp_rank, mesh.dp)
            value = self.pipe.eval_loss(shard.inputs, shard.targets,
                                        denominator=replica_denominator(batch.targets, mesh.dp))
            if isinstance(self.dp, ShardedGradients):
                self.dp.reshard()
            return replica_mean([value], mesh, cpu)[0]

        def save(self, path, step):
            save_checkpoint(path, step, modules=self.pipe.modules, optimizer=self.opt,
                            model={"name": self.model}, group=world)

        def load(self, path):
            load_checkpoint(path, modules=self.pipe.modules, optimizer=self.opt,
                            model={"name": self.model}, group=world)

    def rel(a, b):
        return float((a - b).norm() / b.norm().clamp_min(1e-12))

    def compare(run, ref_params):
        # A tied copy (the head on pp rank 1) against the reference's one tensor.
        names = run.pipe.tied_names
        return {n: rel(w, ref_params[names.get(n, n)]) for n, w in run.weights().items()}

    cases = {}
    refs = {}
    for name, model, schedule, mode, ignored, accum, chunks in (
        ("shard-1f1b", "llama", "1f1b", "shard", False, 1, None),
        ("shard-zb-h1", "llama", "zb-h1", "shard", False, 1, None),
        ("shard-1f1b-accum2", "llama", "1f1b", "shard", False, 2, None),
        ("shard-interleaved", "llama", "interleaved-1f1b", "shard", False, 1, 2),
        ("ddp-ignored", "llama", "zb-h1", "ddp", True, 1, None),
        ("shard-ignored", "llama", "zb-h1", "shard", True, 1, None),
        ("shard-tied-zb-h1", "gpt2", "zb-h1", "shard", True, 1, None),
    ):
        batches = IGNORED if ignored else PLAIN
        key = (model, ignored, accum)
        if key not in refs:
            refs[key] = reference(model, batches, accum)
        ref_rows, ref_params, ref_eval = refs[key]
        run = Run(model, schedule, mode, chunks)
        rows = [run.step(step, batches, accum) for step in range(STEPS)]
        cases[name] = {
            "rows": rows,
            "ref_rows": ref_rows,
            "weight_errors": compare(run, ref_params),
            "eval": run.eval_loss(batches[-1]),
            "ref_eval": ref_eval,
            "sharded_grads": mode == "shard" and all(
                isinstance(p, DTensor) for p in run.pipe.parameters()),
            "state_bytes": state_bytes(run.pipe.parameters(), run.opt),
            "stages": list(run.pipe.stages),
            "gathers": list(run.gathers),
            "prefetched": list(run.prefetched),
            "early": list(run.early),
        }
        if name == "shard-1f1b":
            # After an eval the stages are sharded again: a step after it still matches.
            before = run.weights()
            state = gather_state_dict(run.pipe.modules, mesh.pp_group)
            if state is not None:
                cases[name]["gathered_errors"] = {
                    n: rel(state[n], before[n]) for n in before if n in state}
                cases[name]["gathered_keys"] = len(state)
        if name == "ddp-ignored":
            ddp_bytes = state_bytes(run.pipe.parameters(), run.opt)
    out = {"cases": cases, "ddp_state_bytes": ddp_bytes}

    # A NaN in rank 3's shard of one weight (the sharded tied run, last stage of replica
    # 1): the reduce-scatter spreads it to some shards only, the loss to every replica
    # through the mean, and the world-wide check makes all four ranks skip.
    if dist.get_rank() == 3:
        with torch.no_grad():
            next(iter(run.pipe.parameters())).to_local().view(-1)[0] = float("nan")
    before = [p.to_local().detach().clone() for p in run.pipe.parameters()]
    run.step(0, IGNORED)
    out["nan_skipped"] = run.skipped
    out["nan_moved"] = any(
        not torch.equal(a.nan_to_num(), p.to_local().detach().nan_to_num())
        for a, p in zip(before, run.pipe.parameters())
    )

    # What the ignored-token cases guard against: each replica's own token mean, averaged
    # with weight 1/dp, is not the full batch's gradient when the token counts differ.
    probe = build_pipeline(model_spec(MODELS["llama"]), schedule="1f1b", microbatches=2,
                           ranks=1, device="cpu", split=block_split(4, 1))

    def gradient(batch):
        probe.zero_grad()
        probe.step(batch.inputs, batch.targets)
        return torch.cat([p.grad.reshape(-1) for p in probe.parameters()])

    full = gradient(IGNORED[0])
    halves = [gradient(shard_batch(IGNORED[0], r, 2)) for r in range(2)]
    out["equal_weights_error"] = rel((halves[0] + halves[1]) / 2, full)

    # Checkpoints: saved after 3 steps under one layout, 2 more steps under another; the
    # losses of steps 4 and 5 must be the reference's.
    root = sys.argv[1]
    ref_rows = refs[("llama", False, 1)][0]
    moves = {}
    saved = {}
    for layout_name, mode, layout in (("shard", "shard", (2, 2)), ("ddp", "ddp", (2, 2)),
                                      ("pp4", "none", (4, 1))):
        run = Run("llama", "1f1b", mode, layout=layout)
        for step in range(3):
            run.step(step, PLAIN)
        run.save(f"{root}/ckpt-{layout_name}", 3)
        saved[layout_name] = f"{root}/ckpt-{layout_name}/step_000003"
    for source, target, mode, layout in (
        ("shard", "pp4", "none", (4, 1)),
        ("shard", "ddp", "ddp", (2, 2)),
        ("ddp", "shard", "shard", (2, 2)),
        ("pp4", "shard", "shard", (2, 2)),
    ):
        run = Run("llama", "1f1b", mode, layout=layout)
        run.load(saved[source])
        moves[f"{source}->{target}"] = {
            "rows": [run.step(step, PLAIN) for step in (3, 4)], "ref_rows": ref_rows[3:5]}
    out["moves"] = moves
    with open(root + f"/rank{dist.get_rank()}.json", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
    # Not through finalization: gloo's threads can abort it (pipetrain.launch.process_exit).
    from pipetrain.launch.process_exit import exit_rank

    exit_rank(0)
    """
)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("dp_shard")
    script = tmp / "worker.py"
    script.write_text(WORKER)
    run = launch(4, [str(tmp)], timeout_s=280.0, worker=script)
    assert run.returncodes == (0, 0, 0, 0), "\n".join(e[-3000:] for e in run.stderr)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(4)]


def _assert_rows(rows: list, ref: list, what: str) -> None:
    assert len(rows) == len(ref) > 0, what
    for step, ((loss, norm, clip), (ref_loss, ref_norm, ref_clip)) in enumerate(
        zip(rows, ref, strict=True)
    ):
        assert loss == pytest.approx(ref_loss, rel=1e-5), (what, step)
        assert norm == pytest.approx(ref_norm, rel=1e-5), (what, step)
        assert clip == pytest.approx(ref_clip, rel=1e-5), (what, step)


CASES = [
    "shard-1f1b",
    "shard-zb-h1",
    "shard-1f1b-accum2",
    "shard-interleaved",
    "ddp-ignored",
    "shard-ignored",
    "shard-tied-zb-h1",
]


@pytest.mark.parametrize("case", CASES)
def test_equals_one_process_on_the_full_batch(results: list[dict], case: str) -> None:
    for out in results:
        got = out["cases"][case]
        _assert_rows(got["rows"], got["ref_rows"], case)
        assert len(got["rows"]) == 5
        assert min(r[2] for r in got["rows"]) < 1.0, "clipping never engaged"
        assert got["weight_errors"], "no parameters compared"
        # A key bias has a gradient of exactly 0 (softmax ignores a shift shared by every
        # key), so AdamW turns rounding noise into full steps of either sign: not comparable.
        bad = {
            n: e
            for n, e in got["weight_errors"].items()
            if not e < 1e-5 and not n.endswith("attn.wk.bias")
        }
        assert not bad, (case, bad)
        assert got["eval"] == pytest.approx(got["ref_eval"], rel=1e-5), case
        assert got["sharded_grads"] == case.startswith("shard"), case


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("shard")])
def test_gathered_once_per_step_up_front_and_reduced_inside_it(
    results: list[dict], case: str
) -> None:
    for out in results:
        got = out["cases"][case]
        # One all-gather per stage per optimizer step, not one per micro-batch: the
        # parameters stay gathered through gradient accumulation too.
        assert got["gathers"] == [len(got["stages"])] * 5, case
        # All of them issued at the start of the step (prefetched), not at the first F.
        assert got["prefetched"] == [len(got["stages"])] * 5, case
        # Every stage's reduce-scatter ran in the pipeline step, right after its last B/W.
        assert got["early"] == [got["stages"]] * 5, case


def test_a_nan_in_one_shard_makes_every_rank_skip(results: list[dict]) -> None:
    assert [out["nan_skipped"] for out in results] == [True] * 4
    assert [out["nan_moved"] for out in results] == [False] * 4


def test_unequal_ignored_tokens_matter(results: list[dict]) -> None:
    # The ignored-token cases would fail with the old weighting of 1/dp per replica: it is
    # off by far more than their tolerance.
    for out in results:
        assert out["equal_weights_error"] > 1e-2


def test_sharding_halves_parameters_and_optimizer_state(results: list[dict]) -> None:
    for out in results:
        sharded = out["cases"]["shard-ignored"]["state_bytes"]
        ddp = out["ddp_state_bytes"]
        # Parameters, exp_avg and exp_avg_sq: 1/dp of each (the scalar steps stay whole).
        assert ddp * 0.45 < sharded < ddp * 0.55, (sharded, ddp)


def test_gather_state_dict_assembles_sharded_stages(results: list[dict]) -> None:
    for rank, out in enumerate(results):
        got = out["cases"]["shard-1f1b"]
        if rank in (0, 1):  # rank 0 of each pipeline (pp group {0, 2} and {1, 3})
            assert got["gathered_keys"] > 0
            assert max(got["gathered_errors"].values()) == 0.0
        else:
            assert "gathered_keys" not in got


@pytest.mark.parametrize("move", ["shard->pp4", "shard->ddp", "ddp->shard", "pp4->shard"])
def test_checkpoints_move_between_sharded_ddp_and_pp4(results: list[dict], move: str) -> None:
    for out in results:
        got = out["moves"][move]
        _assert_rows(got["rows"], got["ref_rows"], move)
