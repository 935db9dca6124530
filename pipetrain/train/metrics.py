"""What a run reports: a progress line, a metrics JSONL file, TensorBoard, a summary.

Only one rank reports (the loss is known on every rank); the others stay quiet unless
something goes wrong. On a terminal the progress is a live bar with the other lines above
it; otherwise (a log file, a CI job) it is plain lines, so a log reads top to bottom.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import resource
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pipetrain.errors import InputError
from pipetrain.heap import release_free_heap
from pipetrain.schedules.execution import Timeline
from pipetrain.train.metrics_file import MetricsError, MetricsFile

__all__ = [
    "MetricsError",
    "MetricsFile",
    "Progress",
    "RunSummary",
    "TensorBoard",
    "draw_timeline",
    "format_duration",
    "measured_bubble",
    "peak_memory_bytes",
    "reset_peak_memory",
]


def format_duration(seconds: float) -> str:
    """``75.2`` -> ``"1:15"``; ``3725`` -> ``"1:02:05"``; unknown -> ``"?"``."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def measured_bubble(timeline: Timeline) -> float:
    """Idle share of ``ranks x makespan`` in a measured step (the GPipe definition)."""
    from pipetrain.sim.metrics import bubble

    return bubble(timeline).idle_fraction


def peak_memory_bytes(device: str) -> int:
    """Peak memory of this process: CUDA allocations on a GPU, resident set size on a CPU.

    On Linux the resident peak is /proc's VmHWM, which ``reset_peak_memory`` can clear;
    ru_maxrss cannot be cleared and starts from the launching process's resident size
    (Linux carries it across fork and exec), so it is only the fallback.
    """
    if device.startswith("cuda"):
        import torch

        # This process's own GPU, whichever device is current.
        return int(torch.cuda.max_memory_allocated(device))
    try:
        status = Path("/proc/self/status").read_text(encoding="ascii")
    except OSError:
        status = ""
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # "VmHWM:   325484 kB"
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    # Linux reports ru_maxrss in KiB, macOS in bytes.
    return peak if sys.platform == "darwin" else peak * 1024


def reset_peak_memory() -> None:
    """Start this process's peak memory afresh, so that a run measures its own peak when
    an earlier run in the same process (``pipetrain tune`` with one process) went higher.

    The earlier run's freed heap goes back to the system first (glibc's kept heap, the
    free pages tcmalloc and jemalloc hold: still resident, they would serve the run's steps
    without counting, or count again); then the resident
    high-water mark resets through /proc (Linux 4.0 and later; elsewhere it stays the
    process's), and the CUDA peak of the current device (a run in this process uses that
    one) when CUDA is in use.
    """
    gc.collect()
    release_free_heap()
    with contextlib.suppress(OSError):
        # "5" resets the resident-set high-water mark (proc(5), /proc/pid/clear_refs).
        Path("/proc/self/clear_refs").write_text("5", encoding="ascii")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def draw_timeline(
    timeline: Timeline, path: str, say: Callable[[str], None], *, taking_turns: bool, what: str
) -> None:
    """Draw the measured ``timeline`` (``what``: "step", "stream (steps 1-3)") to ``path``,
    a picture or (``.json``) a Chrome/Perfetto trace.

    After the last step nothing else is at stake: a picture that cannot be written (a
    path checked at the start can still fail: /proc, a full disk) is a warning, and the
    run goes on to its sample and exits as it would have, where an error on this one rank
    would have lost the sample and left its peers reporting a lost rank.
    """
    from pipetrain.sim.render import plot, write_chrome_trace

    try:
        if path.endswith(".json"):
            write_chrome_trace(timeline, path, us_per_unit=1e6)  # seconds to microseconds
        else:
            plot(timeline, path, unit="s", taking_turns=taking_turns)
    except InputError as exc:
        say(f"warning: the measured timeline of the last {what} was not drawn: {exc}")
        return
    done = "written" if path.endswith(".json") else "drawn"
    say(f"measured timeline of the last {what} {done} to {path}")


class TensorBoard:
    """Scalars of each metrics line, through torch.utils.tensorboard (needs tensorboard)."""

    def __init__(self, folder: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ModuleNotFoundError:
            raise MetricsError(
                "run.tensorboard needs the 'tensorboard' package, which is not installed: "
                "pip install tensorboard, or drop --tensorboard"
            ) from None
        self._writer = SummaryWriter(log_dir=str(folder))

    def write(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class Progress:
    """Step, loss, tokens/s and ETA: on a terminal (and ``bar``: ``run.progress_bar``) a
    tqdm bar redrawn every step, ``message`` lines above it, closed at the last step or by
    ``close`` (a failed or stopped run); elsewhere (a file, a pipe, CI) plain lines."""

    def __init__(
        self, total_steps: int, stream: IO[str] | None = None, *, bar: bool = True
    ) -> None:
        self._total = total_steps
        self._stream = sys.stdout if stream is None else stream
        self._tty = bar and bool(getattr(self._stream, "isatty", lambda: False)())
        # Plain lines: about 100 for a long run, every step for a short one.
        self._every = max(1, total_steps // 100)
        # The first step this process trains (a resumed run starts later than 0).
        self._first: int | None = None
        self._bar: Any = None  # opened at the first step: the lines before it are plain

    def update(
        self, step: int, *, loss: float, tokens_per_s: float, elapsed_s: float, note: str = ""
    ) -> None:
        """After optimizer step ``step`` (from 0) finished, ``elapsed_s`` after the first began."""
        if self._first is None:
            self._first = step
        done = step + 1
        eta = elapsed_s / (done - self._first) * (self._total - done)
        numbers = f"loss {loss:.4f}  {tokens_per_s:,.0f} tok/s  ETA {format_duration(eta)}"
        text = f"step {done}/{self._total}  {numbers}"
        if note:
            text += f"  {note}"
        if not self._tty:
            if note or done % self._every == 0 or done == self._total:
                self._stream.write(text + "\n")
                self._stream.flush()
            return
        if note:
            # A note stays in the log, above the bar, as the plain line says it.
            self.message(text)
        if self._bar is None:
            # Opened at its first step, drawn with it (a resumed run's bar starts part full).
            from tqdm import tqdm

            if not hasattr(tqdm, "_lock"):  # one writer: no multiprocessing lock (semaphore)
                tqdm.set_lock(threading.RLock())
            self._bar = tqdm(
                total=self._total,
                initial=done,
                desc=numbers,
                file=self._stream,
                # Every step redrawn: steps are seconds apart, not microseconds.
                mininterval=0,
                miniters=1,
                # The terminal's size, followed as it changes; on a terminal that tells none
                # (a pty of size 0, as `script` gives) tqdm would draw nothing: 80 x 24.
                **({"dynamic_ncols": True} if _sized(self._stream) else _DEFAULT_SIZE),
                bar_format="step {n_fmt}/{total_fmt} |{bar}| {desc}",
            )
        else:
            self._bar.set_description_str(numbers, refresh=False)
            self._bar.update(done - self._bar.n)
        if done >= self._total:
            self.close()

    def message(self, text: str) -> None:
        """A line of its own (eval results, warnings, the summary), above the bar."""
        if self._bar is not None:
            self._bar.write(text, file=self._stream)
        else:
            self._stream.write(text + "\n")
        self._stream.flush()

    def close(self) -> None:
        """End the bar's line (again, or without a bar: nothing)."""
        bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()
            self._stream.flush()


_DEFAULT_SIZE = {"ncols": 80, "nrows": 24}


def _sized(stream: IO[str]) -> bool:
    """Whether the terminal ``stream`` writes to tells its size (a StringIO has no fd)."""
    try:
        return min(os.get_terminal_size(stream.fileno())) > 0
    except (OSError, ValueError):
        return False


class RunOutput:
    """Where a run's output goes: on the reporting rank a progress bar (plain lines when not
    on a terminal, or not ``progress_bar``), the metrics file and TensorBoard when asked; on
    every other rank nothing, so that their logs stay quiet unless something is wrong."""

    def __init__(
        self,
        *,
        active: bool,
        total_steps: int,
        stream: IO[str] | None,
        metrics_path: Path,
        tensorboard_dir: Path | None,
        resume: bool = False,
        progress_bar: bool = True,
    ) -> None:
        self.progress = Progress(total_steps, stream, bar=progress_bar) if active else None
        self._metrics = MetricsFile(metrics_path, append=resume) if active else None
        self._board = (
            TensorBoard(tensorboard_dir) if active and tensorboard_dir is not None else None
        )

    def report(self, record: Mapping[str, Any]) -> None:
        """A record for the metrics file and TensorBoard."""
        if self._metrics is not None:
            self._metrics.write(record)
        if self._board is not None:
            self._board.write(record)

    def resume_from(self, step: int) -> None:
        """A resumed run starts at ``step``: the metrics keep one trajectory
        (``MetricsFile.resume_from``), with a note where records were moved."""
        if self._metrics is not None and step:
            note = self._metrics.resume_from(step)
            if note is not None:
                self.say(note)

    def record(self, record: Mapping[str, Any]) -> None:
        """A record for the metrics file only (summaries that are not per-step scalars)."""
        if self._metrics is not None:
            self._metrics.write(record)

    def say(self, text: str) -> None:
        if self.progress is not None:
            self.progress.message(text)

    def close(self) -> None:
        """End the progress bar's line, flush and close the files (again: nothing). A failed
        or stopped run closes them too: its ranks end with ``os._exit``
        (``pipetrain.launch.process_exit``), where no finalizer would."""
        if self.progress is not None:
            self.progress.close()
        metrics, board = self._metrics, self._board
        self._metrics = self._board = None
        if metrics is not None:
            metrics.close()
        if board is not None:
            try:
                board.close()
            except OSError as exc:  # a full disk: the run's end is not worth a traceback
                self.say(f"warning: TensorBoard's last events were not written ({exc.strerror})")


@dataclass(frozen=True)
class RunSummary:
    """The numbers a finished run is judged by."""

    steps: int
    wall_s: float
    tokens: int
    # Tokens per second over the training steps (evaluation and start-up excluded).
    tokens_per_s: float
    # Idle share of the pipeline, measured on the steps, and simulated from the measured
    # action durations for the same schedule (None where there is no pipeline).
    measured_bubble: float | None
    simulated_bubble: float | None
    first_eval_loss: float
    final_eval_loss: float
    # Peak memory (bytes) of each rank, in rank order.
    peak_memory: tuple[int, ...]
    skipped_steps: int
    # The first steps, left out of tokens_per_s (allocations; an asynchronous run's first
    # stream); 0 when the run had no others.
    untimed_steps: int = 1
    # Bytes of parameters and optimizer state each rank holds (its shards where sharded:
    # --shard, --tp), in rank order; empty where not measured.
    state_bytes: tuple[int, ...] = ()
    # Micro-batches per pipeline step at the end (--microbatches auto's choice); 0: not given.
    microbatches: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "summary": True,
            **{k: v for k, v in self.__dict__.items() if k not in ("peak_memory", "state_bytes")},
            "peak_memory": list(self.peak_memory),
            "state_bytes": list(self.state_bytes),
        }

    def format(self) -> str:
        """A few lines for the end of the run log."""
        lines = [
            f"trained {self.steps} step{'' if self.steps == 1 else 's'}, {self.tokens:,} tokens in {format_duration(self.wall_s)} "
            f"({self.wall_s:.1f} s with start-up and evaluation); {self.tokens_per_s:,.0f} "
            f"tokens/s over {self._timed()}",
        ]
        if math.isfinite(self.first_eval_loss) and math.isfinite(self.final_eval_loss):
            drop = 1.0 - self.final_eval_loss / self.first_eval_loss
            lines.append(
                f"eval loss {self.first_eval_loss:.4f} -> {self.final_eval_loss:.4f} ({drop:.0%} lower)"
            )
        simulated = "n/a" if self.simulated_bubble is None else f"{self.simulated_bubble:.1%}"
        if self.measured_bubble is not None:
            lines.append(f"bubble: measured {self.measured_bubble:.1%}, simulated {simulated}")
        elif self.simulated_bubble is not None:
            lines.append(
                f"bubble: simulated {simulated} (not measured: every rank ran in one process)"
            )
        shared = self.measured_bubble is None and self.simulated_bubble is not None
        lines.append(
            ("peak memory of the one process: " if shared else "peak memory per rank: ")
            + ", ".join(_mib(b) for b in self.peak_memory)
        )
        if self.skipped_steps:
            lines.append(f"skipped updates (non-finite loss or gradient): {self.skipped_steps}")
        return "\n".join(lines)

    def _timed(self) -> str:
        if self.untimed_steps == 0:
            only = "its only step" if self.steps == 1 else f"all {self.steps} steps"
            return f"{only} (allocations included: too few to leave the first out)"
        if self.untimed_steps == 1:
            return "the training steps after the first"
        return f"the training steps after the first {self.untimed_steps} (the first stream)"


def _mib(size: float) -> str:
    return f"{size / 2**20:,.0f} MiB"
