"""What the runs of a ``plan_auto.py`` sweep held beyond the memory model, and which form of
the workspace explains it best.

    .venv/bin/python benchmarks/plan_memory_fit.py '/tmp/pa/runs-default/llama-default-w4-r0-*' ...

For every run folder (its ``config.toml`` and the memory check in its ``metrics.jsonl``) and
every process: the measured peak less the model's count from the shapes (weights,
gradients, AdamW state, the simulated peak of activations with the split backward's terms,
buffers; ``pipetrain.partition.estimate``, the run's own split), against two candidate
workspaces: a fraction of one micro-batch in flight on the rank's largest stage, or of the
rank's peak live activations. Each is fitted with a constant by least squares; printed:
the coefficients, the rms of what is left, and that as a share of the measured peak.
docs/memory_model.md and BENCHMARKS.md (the eighth sweep) have the figures.
"""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path

import numpy as np

from pipetrain.cli.plan_auto import HARDWARE
from pipetrain.config import load_config
from pipetrain.models.config import get_model_config
from pipetrain.partition.balance import split_explicit
from pipetrain.partition.estimate import estimate_costs
from pipetrain.partition.layouts import AutoRequest, Layout
from pipetrain.partition.scoring import Scorer
from pipetrain.partition.stages import stage_ranks_of

_MIB = 2**20
_HW = HARDWARE["cpu"]


def counted_processes(run: Path) -> list[tuple[str, float, float, float, float]]:
    """(layout, measured, counted, in flight, peak activations) in MiB, per process."""
    config = load_config(run / "config.toml", {}, check_paths=False)
    p = config.pipeline
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    check = next((r for r in records if r.get("memory_check")), None)
    if check is None or p.recompute_ranks:
        return []
    model = get_model_config(config.model.name)
    seq_len, batch = config.data.seq_len, config.data.batch_size
    layout = Layout(p.schedule, p.pp, p.dp, p.tp, p.chunks, p.microbatches, p.recompute,
                    p.early_grads)  # fmt: skip

    def costs(tp: int, mb: int = 1):  # type: ignore[no-untyped-def]
        return estimate_costs(model, seq_len, flops_per_second=_HW.flops, tp=tp)

    scorer = Scorer(model, AutoRequest(p.pp * p.dp * p.tp, batch, seq_len), costs, _HW)
    schedule = scorer.schedule(layout)
    blocks = [int(n) for n in p.split.split(",")] if p.split else [model.n_layers]
    partition = split_explicit(
        scorer.layout_costs(layout), blocks, stage_ranks_of(schedule.placement)
    )
    scored = scorer.score(layout, schedule, partition, False)
    out = []
    measured = check["measured_peak"]
    for process, peak in enumerate(measured):
        m = scored.memory[process * len(scored.memory) // len(measured)]  # pp-major
        counted = m.total - m.workspace
        out.append((layout.describe(), peak / _MIB, counted / _MIB, m.in_flight / _MIB,
                    m.activations / _MIB))  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="run folders, or patterns of them")
    args = p.parse_args()
    rows = [row for pattern in args.runs for run in sorted(glob.glob(pattern))
            for row in counted_processes(Path(run))]  # fmt: skip
    if not rows:
        raise SystemExit(
            "no run folder with a memory check matched: pass plan_auto.py's --out runs"
        )
    measured = np.array([r[1] for r in rows])
    beyond = measured - np.array([r[2] for r in rows])
    ones, in_flight, live = (
        np.ones(len(rows)),
        np.array([r[3] for r in rows]),
        np.array([r[4] for r in rows]),
    )
    print(f"{len(rows)} processes of {len({r[0] for r in rows})} layouts; beyond the count: "
          f"{beyond.mean():.1f} MiB on average ({beyond.min():.1f} to {beyond.max():.1f})")  # fmt: skip
    for name, x in (
        ("constant + fraction of the micro-batch in flight", np.c_[ones, in_flight]),
        ("constant + fraction of the live activations", np.c_[ones, live]),
        ("constant + both", np.c_[ones, in_flight, live]),
    ):
        coef, *_ = np.linalg.lstsq(x, beyond, rcond=None)
        left = beyond - x @ coef
        share = np.abs(left) / measured
        print(f"{name}: coefficients {', '.join(f'{c:.3f}' for c in coef)}; left "
              f"{np.sqrt((left**2).mean()):.1f} MiB rms, {share.mean():.1%} of the peak on "
              f"average, {share.max():.1%} at most")  # fmt: skip


if __name__ == "__main__":
    main()
