"""A full disk seen by one rank of two (gloo): every rank stops alike, in the same line.

1. Rank 1's writes fail with ENOSPC (a faked writer, on that rank only) while rank 0's
   succeed: both ranks raise the same one-line error, the partial folder is gone and the
   earlier checkpoint is intact.
2. Rank 0 finds too little free space (faked, on rank 0 only: the decision is its): both
   ranks refuse the save before either writes, in the same line.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from runtime_launch import launch

from pipetrain.checkpoint import list_checkpoints, verify_checkpoint

pytestmark = pytest.mark.dist

WORKER = textwrap.dedent(
    """
    import errno, json, os, sys
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from pipetrain.checkpoint import CheckpointError, save_checkpoint
    from pipetrain.checkpoint import save as save_module, space

    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = nn.Linear(32, 32)
    model.layer_indices = (rank,)
    save_checkpoint(root, 1, modules=model, model={"family": "toy"})

    class Full(FileSystemWriter):
        def write_data(self, plan, planner):
            written = super().write_data(plan, planner)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    errors = []
    real = save_module.FileSystemWriter
    if rank == 1:
        save_module.FileSystemWriter = Full
    try:
        save_checkpoint(root, 2, modules=model, model={"family": "toy"})
    except CheckpointError as exc:
        errors.append(str(exc))
    save_module.FileSystemWriter = real
    if rank == 0:
        space.free_bytes = lambda path: 1000
    try:
        save_checkpoint(root, 3, modules=model, model={"family": "toy"})
    except CheckpointError as exc:
        errors.append(str(exc))
    Path(f"{out}.{rank}").write_text(json.dumps(errors))
    dist.destroy_process_group()
    """
)


def test_a_full_disk_on_one_rank_stops_every_rank_in_the_same_line(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    root, out = tmp_path / "ckpt", tmp_path / "out"
    result = launch(2, [str(root), str(out)], worker=script, timeout_s=120)
    assert result.returncodes == (0, 0), result.stderr
    errors = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]
    assert errors[0] == errors[1] and len(errors[0]) == 2
    failed, refused = errors[0]
    assert failed.startswith(
        f"saving the checkpoint of step 2 into {root} failed: no space left on the device "
        "(rank 1; it needs about "
    )
    assert "the partial save was removed and the earlier checkpoints are kept (newest " in failed
    assert refused.startswith(f"not enough space for the checkpoint of step 3 in {root}: ")
    assert "and 0.0 MB are free; the earlier checkpoints are kept (newest step_000001)" in refused
    found = list_checkpoints(root)
    assert found.partial == () and [step for step, _ in found.complete] == [1]
    assert verify_checkpoint(found.complete[0][1]).ok
