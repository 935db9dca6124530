"""One rank of the user-model test: a pipeline over gloo that loads a full state dict
(each rank its own layers) and steps with per-batch side inputs; writes its loss."""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from test_user_model import batch, mean_ce, user_spec  # noqa: E402

from pipetrain.launch.process_exit import exit_rank  # noqa: E402
from pipetrain.models import build_full_model  # noqa: E402
from pipetrain.runtime import build_pipeline  # noqa: E402


def main() -> int:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    spec = user_spec()
    pipe = build_pipeline(
        spec,
        schedule="1f1b",
        microbatches=2,
        group=dist.group.WORLD,
        device="cpu",
        seed=1,
        loss_fn=mean_ce,
        loss_reduction="mean",
        timeout_s=60.0,
    )
    pipe.load_state_dict(build_full_model(spec, seed=2, device="cpu").state_dict())
    inputs, targets, positions = batch()
    result = pipe.step(inputs, targets, extras={"positions": positions})
    names = sorted(pipe.state_dict())
    (out / f"rank{rank}.json").write_text(json.dumps({"loss": result.loss, "names": names}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_rank(main())
