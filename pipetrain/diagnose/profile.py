"""``--profile STEPS``: torch.profiler on every rank for those training steps.

The trainer opens a ``StepProfiler`` and runs each step inside ``profiler.step(n)``: on the
first profiled step the profiler starts (CPU activities; CUDA too on a GPU), each
profiled step runs its pipeline actions inside named ranges (``Pipeline.step(ranges=
True)``: ``F stage 1 mb 3``, ``RECV_B stage 0 mb 2``, NVTX on CUDA), and after the last one
every rank writes into ``<run dir>/profile/``:

- ``rank<R>.trace.json``: its own trace (``export_chrome_trace``);
- ``rank<R>_top_ops.txt``: its operators by self time (``key_averages``), the
  pipeline's ranges left out;

then, once every rank has written, rank 0 merges the traces into ``trace.json``, one
track per rank on the runtime's merged clock (``pipetrain.diagnose.trace_merge``), and
prints a short summary. Steps outside STEPS run the plain handler table: nothing is
recorded or wrapped there, and nothing changes a run's numbers.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from pipetrain.config import TrainConfig
from pipetrain.diagnose.trace_merge import RankTrace, merge_traces, range_totals
from pipetrain.runtime.ranges import parse_range_name
from pipetrain.schedules import Schedule

__all__ = ["ProfileSettings", "StepProfiler", "open_profiler", "profiled_step", "write_top_ops"]

_TOP_OPS = 25


@dataclass(frozen=True)
class ProfileSettings:
    """What to profile and where this process's share goes."""

    steps: range  # training steps, counted from 1
    folder: Path  # <run dir>/profile
    rank: int  # this process's global rank
    world_size: int  # processes of the run (1: one process, maybe every pipeline rank)
    replicas: int  # processes per pipeline rank (dp x tp): rank // replicas is its pp rank
    rank_of_stage: Callable[[int], int]  # the pipeline rank of a global stage
    cuda: bool = False
    shapes: bool = False
    memory: bool = False


class StepProfiler:
    """Profiles the training steps ``settings.steps`` (see the module's docstring)."""

    def __init__(self, settings: ProfileSettings, say: Callable[[str], None]) -> None:
        self.settings = settings
        self._say = say
        self._prof: profile | None = None

    def covers(self, step: int) -> bool:
        """Whether the training step ``step`` (counted from 1) is profiled."""
        return step in self.settings.steps

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[bool]:
        """Around training step ``step`` (from 1): yields whether to run it with ranges."""
        if not self.covers(step):
            yield False
            return
        if self._prof is None:
            self._prof = self._start()
        with record_function(f"training step {step}"):
            yield True
        if step == self.settings.steps[-1]:
            prof, self._prof = self._prof, None
            prof.stop()
            self._write(prof)

    def _start(self) -> profile:
        s = self.settings
        activities = [ProfilerActivity.CPU]
        if s.cuda:
            activities.append(ProfilerActivity.CUDA)
        prof = profile(activities=activities, record_shapes=s.shapes, profile_memory=s.memory)
        prof.start()
        return prof

    def _write(self, prof: profile) -> None:
        s = self.settings
        s.folder.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_path(s.folder, s.rank)))
        write_top_ops(prof, s.folder / f"rank{s.rank}_top_ops.txt", cuda=s.cuda)
        if s.world_size > 1:
            # Every rank's trace is on disk before rank 0 reads them (the process group's
            # timeout bounds the wait).
            dist.barrier()
        if s.rank == 0:
            self._merge()

    def _merge(self) -> None:
        s = self.settings
        traces = []
        for rank in range(s.world_size):
            events = json.loads(trace_path(s.folder, rank).read_text())["traceEvents"]
            pipeline_rank = rank // s.replicas if s.world_size > 1 else None
            traces.append(RankTrace(rank, events, pipeline_rank, rank % s.replicas))
        merged = merge_traces(traces, s.rank_of_stage)
        path = s.folder / "trace.json"
        path.write_text(json.dumps(merged) + "\n", encoding="utf-8")
        self._say(summary(merged, s.steps, path, s.folder))


def open_profiler(
    config: TrainConfig,
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    schedule: Schedule,
    say: Callable[[str], None],
) -> StepProfiler | None:
    """The run's profiler (None without run.profile); every process opens its own."""
    r, p = config.run, config.pipeline
    if not r.profile:
        return None
    settings = ProfileSettings(
        steps=r.profile_steps,
        folder=config.run_dir / "profile",
        rank=rank,
        world_size=world_size,
        replicas=p.dp * p.tp,
        rank_of_stage=schedule.placement.rank_of,
        cuda=device.type == "cuda" and torch.cuda.is_available(),
        shapes=r.profile_shapes,
        memory=r.profile_memory,
    )
    return StepProfiler(settings, say)


def trace_path(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.trace.json"


@contextlib.contextmanager
def profiled_step(profiler: StepProfiler | None, step: int) -> Iterator[bool]:
    """``profiler.step(step)``, or a step without ranges when there is no profiler."""
    if profiler is None:
        yield False
        return
    with profiler.step(step) as ranges:
        yield ranges


def write_top_ops(prof: profile, path: Path, *, cuda: bool) -> None:
    """The operators by self time, one line each (the pipeline's own ranges left out)."""
    rows = []
    for avg in prof.key_averages():
        if parse_range_name(avg.key) is not None or avg.key.startswith("training step "):
            continue
        device = float(getattr(avg, "self_device_time_total", 0.0)) if cuda else 0.0
        rows.append(
            (float(avg.self_cpu_time_total), device, float(avg.cpu_time_total), avg.count, avg.key)
        )
    rows.sort(key=lambda r: (r[1], r[0]) if cuda else (r[0],), reverse=True)
    lines = [_row("self cpu ms", "self gpu ms", "cpu ms", "calls", "operator")]
    lines += [
        _row(f"{c / 1e3:.3f}", f"{g / 1e3:.3f}", f"{t / 1e3:.3f}", str(n), k)
        for c, g, t, n, k in rows[:_TOP_OPS]
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _row(cpu: str, gpu: str, total: str, calls: str, name: str) -> str:
    return f"{cpu:>12}  {gpu:>12}  {total:>10}  {calls:>6}  {name}"


def top_op(path: Path) -> str:
    """The first operator of a ``write_top_ops`` table with its self time ("" if none)."""
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    if len(lines) < 2:
        return ""
    cpu, gpu, _, _, name = lines[1].split(maxsplit=4)
    return f"{name} {max(float(cpu), float(gpu)):.1f} ms self"


def summary(merged: dict[str, Any], steps: Sequence[int], path: Path, folder: Path) -> str:
    """A few lines: where the trace is, and per rank the time in its ranges."""
    span = f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"
    lines = [
        f"profile of step{'s' if len(steps) > 1 else ''} {span}: {path} (open in ui.perfetto.dev)"
    ]
    for rank, t in sorted(range_totals(merged).items()):
        top = top_op(folder / f"rank{rank}_top_ops.txt")
        lines.append(
            f"  rank {rank}: compute {t['compute'] / 1e3:.1f} ms, send {t['send'] / 1e3:.1f} ms, "
            f"receive {t['recv'] / 1e3:.1f} ms" + (f"; top operator {top}" if top else "")
        )
    lines.append(f"  top operators per rank: {folder}/rank<R>_top_ops.txt")
    return "\n".join(lines)
