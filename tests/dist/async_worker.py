"""One rank of the asynchronous pipelines' multi-process checks (4 processes, gloo).

``async_worker.py OUT``: on all four ranks PipeDream, PipeDream with vertical sync and
PipeDream-2BW, two streams each; then two 2-rank pipelines side by side (PipeDream on
ranks 0-1, PipeDream-2BW on ranks 2-3).
Every rank saves its losses, its stages' weights and its version counts to OUT/rank<r>.pt;
the test compares them with the single-process reference.
"""

from __future__ import annotations

import datetime
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from pipetrain.models import get_model_config, model_spec
from pipetrain.train.pipedream.trainer import AsyncTrainer
from pipetrain.launch.process_exit import exit_rank

STREAM_STEPS, STREAMS, WINDOW, BATCH, SEQ = 2, 2, 4, 8, 16


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STREAM_STEPS * STREAMS):
        ids = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def sgd(params, names=None):  # type: ignore[no-untyped-def]
    params = [p for _, p in params] if names is None else params
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _case(schedule: str, pp: int, vertical: bool, group, local_rank: int) -> dict[str, object]:  # type: ignore[no-untyped-def]
    spec = model_spec(get_model_config("llama-tiny", n_layers=4))
    data = batches()
    trainer = AsyncTrainer(
        spec,
        schedule=schedule,
        pp=pp,
        microbatches=WINDOW,
        stream_steps=STREAM_STEPS,
        make_optimizer=sgd,
        vertical_sync=vertical,
        group=group,
        device="cpu",
        timeout_s=60.0,
    )
    first = local_rank == 0
    last = local_rank == pp - 1
    losses: list[float] = []
    for s in range(STREAMS):
        chunk = data[s * STREAM_STEPS : (s + 1) * STREAM_STEPS]
        result = trainer.train_stream(
            s * STREAM_STEPS,
            torch.cat([b[0] for b in chunk]) if first else None,
            torch.cat([b[1] for b in chunk]) if last else None,
        )
        losses.extend(result.losses)
    return {
        "losses": losses,
        "weights": {n: p.detach().clone() for n, p in trainer.pipeline.named_parameters()},
        "peaks": list(trainer.rank_peaks()),
        "live_after": list(trainer.versions.live().values()),
    }


def main() -> int:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    report: dict[str, object] = {}
    try:
        for name, schedule, vertical in (
            ("pipedream", "pipedream", False),
            ("pipedream-vsync", "pipedream", True),
            ("pipedream-2bw", "pipedream-2bw", False),
        ):
            report[f"{name}/4"] = _case(schedule, 4, vertical, dist.group.WORLD, rank)
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        mine = pairs[rank // 2]
        schedule = "pipedream" if rank < 2 else "pipedream-2bw"
        report[f"{schedule}/2"] = _case(schedule, 2, False, mine, rank % 2)
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        torch.save(report, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_rank(main())  # not through finalization: gloo's threads can abort it (process_exit)
