"""Checkpoints across gloo processes, in one torchrun launch of 4 ranks.

1. 4 ranks, 4 stages, 1F1B (tied embedding on stages 0 and 3): train 2 steps, save, then
   train 2 more: the reference losses.
2. A fresh 4-stage pipeline loads it and repeats those 2 steps: bit-exact losses.
3. At the same time, two 2-rank groups load it under other layouts: ranks {0, 1} as
   2 stages with GPipe, ranks {2, 3} as a V shape (ZB-V: 4 stages on 2 ranks, the tied
   copies on one rank): the same losses.
4. A save that dies (SIGKILL on rank 0 between the manifest and the rename) takes the
   job down; the previous checkpoint stays valid and loadable, the partial one ignored,
   and its export into the single-process model gives the pipeline's loss.
"""

from __future__ import annotations

import json
import logging
import os
import textwrap
from pathlib import Path

import pytest
import torch
from runtime_launch import torchrun

from pipetrain.checkpoint import (
    choose_resume,
    export_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_weights,
    verify_checkpoint,
)
from pipetrain.checkpoint.save import KILL_BEFORE_RENAME_ENV
from pipetrain.models import build_full_model, get_model_config, model_spec

pytestmark = pytest.mark.dist

WORKER = textwrap.dedent(
    """
    import dataclasses, json, os, sys
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from pipetrain.checkpoint import Layout, load_checkpoint, save_checkpoint
    from pipetrain.checkpoint.save import KILL_BEFORE_RENAME_ENV
    from pipetrain.models import get_model_config, model_spec
    from pipetrain.runtime import build_pipeline
    from pipetrain.schedules.gpipe import gpipe
    from pipetrain.schedules.one_f_one_b import one_f_one_b
    from pipetrain.schedules.zero_bubble import zb_v

    root, out_base = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = get_model_config("gpt2-tiny")
    spec = model_spec(config)
    fields = dataclasses.asdict(config)
    fields.pop("name")

    def batch(step):
        ids = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(step))
        return ids[:, :-1], ids[:, 1:]

    def pipeline(schedule, group, seed):
        pipe = build_pipeline(spec, schedule=schedule, microbatches=4, group=group,
                              device="cpu", seed=seed, timeout_s=60)
        return pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-2)

    def train(pipe, opt, steps):
        losses = []
        for step in steps:
            result = pipe.step(*batch(step))
            opt.step()
            pipe.zero_grad()
            losses.append(result.loss)
        return losses

    out = {}
    world = dist.group.WORLD
    pipe, opt = pipeline(one_f_one_b(4, 4), world, seed=0)
    train(pipe, opt, [0, 1])
    layout = Layout(pp=4, chunks=1, schedule="1f1b", world_size=4, stages=pipe.split)
    saved = save_checkpoint(root, 2, modules=pipe.modules, optimizer=opt, model=fields,
                            layout=layout, trainer={"data_step": 2}, group=world)
    out["saved"] = str(saved.path)
    out["reference"] = train(pipe, opt, [2, 3])

    pipe, opt = pipeline(one_f_one_b(4, 4), world, seed=1)
    loaded = load_checkpoint(saved.path, modules=pipe.modules, optimizer=opt, model=fields,
                             group=world)
    out["trainer"] = dict(loaded.trainer)
    out["same_layout"] = train(pipe, opt, [2, 3])

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    schedule = gpipe(2, 4) if rank < 2 else zb_v(2, 4)
    pipe, opt = pipeline(schedule, mine, seed=2)
    load_checkpoint(saved.path, modules=pipe.modules, optimizer=opt, model=fields, group=mine)
    out["other_layout"] = [schedule.name, train(pipe, opt, [2, 3])]
    Path(f"{out_base}.{rank}").write_text(json.dumps(out))

    dist.barrier()
    os.environ[KILL_BEFORE_RENAME_ENV] = "4"
    save_checkpoint(root, 4, modules=pipe.modules, optimizer=opt, model=fields, group=world)
    Path(f"{out_base}.{rank}.survived").write_text("rank 0 should have died before this")
    """
)


def test_save_4_stages_load_same_and_other_layouts_and_survive_a_kill(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    root = tmp_path / "ckpt"
    out_base = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(KILL_BEFORE_RENAME_ENV, None)
    returncode, stderr = torchrun(script, 4, [str(root), str(out_base)], env)
    results = []
    for rank in range(4):
        path = Path(f"{out_base}.{rank}")
        assert path.exists(), stderr[-3000:]
        results.append(json.loads(path.read_text()))

    reference = results[0]["reference"]
    for rank, out in enumerate(results):
        assert out["reference"] == reference  # every rank knows the loss
        assert out["same_layout"] == reference, rank  # bit-exact under the same layout
        assert out["trainer"] == {"data_step": 2}
        name, losses = out["other_layout"]
        assert name == ("gpipe" if rank < 2 else "zb-v")
        assert losses == pytest.approx(reference, rel=1e-6, abs=0), (rank, name)

    # The killed save: the job failed, nobody got past it, the old checkpoint is intact.
    assert returncode != 0
    assert not list(tmp_path.glob("out.*.survived"))
    found = list_checkpoints(root)
    assert [step for step, _ in found.complete] == [2]
    assert len(found.partial) == 1 and found.partial[0].name.startswith("step_000004.tmp-")
    assert (found.partial[0] / "manifest.json").exists()  # killed after the manifest
    with caplog.at_level(logging.WARNING, logger="pipetrain.checkpoint"):
        choice = choose_resume(root)
    assert choice.path == root / "step_000002" and choice.skipped == ()
    assert "an unfinished save" in caplog.text
    assert verify_checkpoint(choice.path).ok

    # Loaded directly, or exported to safetensors and read back, the single-process model
    # gives the loss the 4-stage pipeline had on the next batch.
    config = get_model_config("gpt2-tiny")
    ids = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(2))
    exported = export_checkpoint(choice.path, tmp_path / "w.safetensors")
    for fill in ("load_checkpoint", "export"):
        full = build_full_model(model_spec(config), seed=7, device="cpu")
        if fill == "export":
            assert load_weights(full, exported.path) == ()
        else:
            load_checkpoint(choice.path, modules=full)
        logits = full(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1))
        assert loss.item() == pytest.approx(reference[0], rel=1e-6), fill
