"""``plan --auto --measure K``: train the planner's K fastest layouts for a few steps each
and keep the fastest measured one that fits, so that the choice rests on measurements.

Each candidate runs as ``pipetrain train`` would run its ``--out`` config (the same
launcher, processes and device), in a temporary run folder that is removed afterwards.
The step time is the median over the steps after the first (which allocates); the peak
per process is the run's own memory check (docs/memory_model.md: on a CPU the peak
resident size over the steps less the baseline, plus the weights; on CUDA the
allocator's peak). A candidate whose measured peak is over ``--memory-limit`` is dropped
however fast it ran; one whose run fails is shown with its last line and dropped.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipetrain.partition.auto import AutoRequest, Scored
from pipetrain.partition.balance import format_bytes

__all__ = ["Measured", "best_measured", "measure_layout", "measure_top", "render_measured"]

# Long enough for a 70B layout's first steps on a cluster; a stuck candidate is named.
_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class Measured:
    """One candidate trained: its measured step, throughput and peak per process."""

    scored: Scored
    step_time: float  # median seconds of the steps after the first; NaN when it failed
    tokens_per_s: float
    measured_peak: tuple[int, ...]  # per process, the run's memory check
    predicted_peak: tuple[float, ...]  # per process, as the run's memory check predicts
    error: str = ""  # the failed run's last line
    # Per pipeline rank, seconds a step waited for the dp all-reduce after the pipeline
    # (the run's ``dp_wait_s``); () where the run had no replicas.
    dp_wait: tuple[float, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.error

    def fits(self, limit: float | None) -> bool:
        return self.ok and (limit is None or max(self.measured_peak, default=0) <= limit)

    def to_json(self) -> dict[str, Any]:
        """What was measured (NaN times of a failed run as null), and the prediction."""
        ok = self.ok and self.step_time == self.step_time
        return {
            "describe": self.scored.layout.describe(),
            "predicted_step_time_s": self.scored.step_time,
            "step_time_s": self.step_time if ok else None,
            "tokens_per_s": self.tokens_per_s if ok else None,
            "measured_peak": list(self.measured_peak),
            "predicted_peak": list(self.predicted_peak),
            "error": self.error or None,
            "dp_wait_s": list(self.dp_wait),
        }


def _set(key: str, value: Any) -> list[str]:
    text = json.dumps(value) if isinstance(value, str) else str(value).lower()
    return ["--set", f"{key}={text}"]


def measure_layout(
    scored: Scored,
    overrides: dict[str, Any],
    *,
    model: str,
    steps: int,
    out_dir: Path,
    name: str,
    extra: Sequence[str] = (),
) -> Measured:
    """Train ``scored``'s layout (``overrides``: its config fields) for ``steps`` steps."""
    command = [sys.executable, "-m", "pipetrain.cli", "train", "--model", model,
               "--steps", str(steps), "--name", name, *_set("run.out_dir", str(out_dir)),
               *_set("optim.warmup_steps", 0), *_set("run.evaluate", False),
               *_set("run.sample_tokens", 0), *_set("run.progress_bar", False),
               *extra]  # fmt: skip
    for key, value in overrides.items():
        command += _set(key, value)
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return _failed(scored, f"no result within {_TIMEOUT_S:.0f} s")
    if result.returncode != 0:
        lines = (result.stderr.strip() or result.stdout.strip()).splitlines()
        return _failed(scored, lines[-1] if lines else f"exit status {result.returncode}")
    records = [
        json.loads(line)
        for line in (out_dir / name / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
    times = [r["step_time_s"] for r in records if "step_time_s" in r]
    summary: dict[str, Any] = next((r for r in records if r.get("summary")), {})
    check: dict[str, Any] = next((r for r in records if r.get("memory_check")), {})
    dp: dict[str, Any] = next((r for r in records if "dp_wait_s" in r), {})
    timed = times[1:] or times
    return Measured(
        scored,
        statistics.median(timed) if timed else float("nan"),
        float(summary.get("tokens_per_s", float("nan"))),
        tuple(int(b) for b in check.get("measured_peak", [])),
        tuple(float(b) for b in check.get("predicted_peak", [])),
        dp_wait=tuple(float(w) for w in dp.get("dp_wait_s", []) if w == w),
    )


def _failed(scored: Scored, line: str) -> Measured:
    nan = float("nan")
    return Measured(scored, nan, nan, (), (), error=line)


def measure_top(
    candidates: Sequence[Scored],
    request: AutoRequest,
    overrides_of: Callable[[Scored, AutoRequest], dict[str, Any]],
    *,
    model: str,
    steps: int,
    say: Callable[[str], None],
    extra: Sequence[str] = (),
    measure: Callable[..., Measured] = measure_layout,
) -> list[Measured]:
    """Train each candidate in turn (progress through ``say``); the measurements in order.
    ``measure``: how one is trained (``measure_layout``'s arguments)."""
    measured = []
    with tempfile.TemporaryDirectory(prefix="pipetrain-measure-") as tmp:
        for i, scored in enumerate(candidates, start=1):
            say(f"measuring {i}/{len(candidates)}: {scored.layout.describe()} ({steps} steps)")
            measured.append(
                measure(
                    scored,
                    overrides_of(scored, request),
                    model=model,
                    steps=steps,
                    out_dir=Path(tmp),
                    name=f"candidate-{i}",
                    extra=extra,
                )
            )
    return measured


def lowered_limit(measured: Sequence[Measured], limit: float) -> float | None:
    """``limit`` less the most that a measured candidate's fullest process held beyond its
    prediction: the budget to plan again under when none fits as measured; None where no
    run measured a peak or the lowered limit would leave nothing."""
    over = [
        max(m.measured_peak) - m.scored.peak_bytes for m in measured if m.ok and m.measured_peak
    ]
    lowered = limit - max(0.0, *over) if over else 0.0
    return lowered if lowered > 0 else None


def best_measured(measured: Sequence[Measured], limit: float | None) -> Measured | None:
    """The fastest measured candidate whose measured peak fits ``limit``."""
    fitting = [m for m in measured if m.fits(limit) and m.tokens_per_s == m.tokens_per_s]
    return max(fitting, key=lambda m: m.tokens_per_s, default=None)


def render_measured(measured: Sequence[Measured], limit: float | None) -> str:
    """Predicted against measured, per candidate, and which one the measurement chose."""
    lines = [
        f"{'#':>2}  {'layout':<46} {'pred ms':>8} {'meas ms':>8} {'tokens/s':>9} "
        f"{'pred peak':>10} {'meas peak':>10}"
    ]
    for i, m in enumerate(measured, start=1):
        s = m.scored
        if not m.ok:
            lines.append(f"{i:>2}  {s.layout.describe():<46} failed: {m.error[:80]}")
            continue
        peak = max(m.measured_peak, default=0)
        over = "" if m.fits(limit) else "  over the limit"
        lines.append(
            f"{i:>2}  {s.layout.describe():<46} {s.step_time * 1e3:>8.1f} {m.step_time * 1e3:>8.1f} "
            f"{m.tokens_per_s:>9,.0f} {format_bytes(s.peak_bytes):>10} {format_bytes(peak):>10}{over}"
        )
    best = best_measured(measured, limit)
    if best is None:
        first = measured[0]
        said = f" (it measured {format_bytes(max(first.measured_peak))})" if first.ok else ""
        lines.append(f"no measured candidate fits the limit{said}")
    else:
        first = measured[0]
        if best is first:
            lines.append("measured: the predicted winner is the fastest measured that fits")
        elif first.ok and first.tokens_per_s == first.tokens_per_s:
            lines.append(
                f"measured winner: {best.scored.layout.describe()}, "
                f"{best.tokens_per_s / first.tokens_per_s:.3f}x the predicted winner's tokens/s"
            )
        else:
            lines.append(f"measured winner: {best.scored.layout.describe()}")
    return "\n".join(lines) + "\n"
