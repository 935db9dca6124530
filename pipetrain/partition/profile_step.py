"""One whole-model training step, run by the trainer's own pipeline: its peak memory as the
run's memory check measures it.

``plan --auto --balance profile`` runs it at each micro-batch size in each of its profile
processes, first thing (the heap that other measurements leave behind would count in a
later peak), so that the planner's bytes come from what a step of this trainer holds on
this machine (docs/plan_auto.md). Its times are not used: scaled to them, the predictions
came out 1.4x (2 processes) to 4x (4 on 2 cores) the measured steps, since a profile's
few steps meet the processes' start-up skew (BENCHMARKS.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["step_peak_bytes"]


def _status_bytes(field: str) -> int:
    try:
        status = Path("/proc/self/status").read_text(encoding="ascii")
    except OSError:
        return 0
    line = next((line for line in status.splitlines() if line.startswith(f"{field}:")), "")
    return int(line.split()[1]) * 1024 if line else 0


def step_peak_bytes(
    spec: Any, ids: torch.Tensor, device: str, seed: int, steps: int = 4, recompute: bool = False
) -> float:
    """Peak bytes of ``steps`` training steps of the whole model on micro-batch ``ids``, by
    the trainer's one-stage pipeline with AdamW: on a CPU the peak resident size less the
    library code, from a baseline taken with the model built, plus the weights; on CUDA
    the allocator's peak over its bytes then, plus the weights. In a process group (the
    profile's processes) the gradients are all-reduced in one flat buffer, as data
    parallelism's buckets are. ``recompute``: every block recomputed in its backward, as
    ``pipeline.recompute`` does it. 0.0 where it cannot be measured."""
    import torch.distributed as dist

    from pipetrain.heap import keep_heap, release_free_heap
    from pipetrain.runtime import build_pipeline

    dev = torch.device(device)
    keep_heap()  # as the trainer's processes: the heap keeps what a step frees
    try:
        pipeline = build_pipeline(
            spec, schedule="1f1b", microbatches=1, ranks=1, device=dev, seed=seed
        )
        if recompute:
            from pipetrain.train.stage_options import apply_stage_options

            for module in pipeline.modules:
                apply_stage_options(
                    module, device=dev, precision="fp32", recompute=True, compile_stage=False
                )
        optimizer = torch.optim.AdamW(pipeline.parameters(), lr=1e-4)
        x = ids.to(dev)
        targets = torch.randint(0, 2, ids.shape, generator=torch.Generator().manual_seed(seed))
        targets = targets.to(dev)
        params = list(pipeline.parameters())
        weights = sum(p.numel() * p.element_size() for p in params)
        release_free_heap()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        else:
            Path("/proc/self/clear_refs").write_text("5", encoding="ascii")
            base = _status_bytes("VmRSS") - _status_bytes("RssFile")
        reduce = dist.is_available() and dist.is_initialized()
        for _ in range(steps):
            pipeline.step(x, targets)
            if reduce:
                flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
                dist.all_reduce(flat)
                del flat
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)  # as the trainer
        if dev.type == "cuda":
            peak = torch.cuda.max_memory_allocated(dev)
        else:
            peak = _status_bytes("VmHWM") - _status_bytes("RssFile")
    except (RuntimeError, MemoryError, OSError):
        return 0.0
    return float(peak - base + weights) if peak else 0.0
