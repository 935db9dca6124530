"""``--microbatches auto`` during the run: the first steps try the counts, the run keeps
the fastest.

The plan holds the schedules of the counts to try (``pipetrain.train.microbatch_counts``:
up to ``MOST_COUNTS``, the configured one first). From the first step this session trains,
each count runs ``STEPS_EACH`` real optimizer steps (training goes on: a step's loss and
gradients are those of the whole batch whatever the count, to float rounding), switched
by ``Pipeline.reschedule`` (the same stages, placement and transport). A count's time is
the faster of its steps, measured by each rank from the step's start to the end of its
update (waiting included); every rank takes the slowest rank's time of each count (one
all-reduce, so every rank decides alike), and the run trains on with the fastest count.

The decision is one metrics record, ``{"microbatches_auto": {"tried": {"4": 0.51, "8":
0.47}, "chosen": 8, "steps": [1, 4]}}``, and one console line; every step record and
the summary carry the count in use (``microbatches``). A resumed run probes again: the
machine, or its load, may differ from the one that chose before.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.train.microbatch_counts import STEPS_EACH, choose
from pipetrain.train.session import Session

__all__ = ["MicrobatchProbe"]


class MicrobatchProbe:
    """The probe of one session; does nothing unless pipeline.microbatches_auto is set
    and the run has steps enough for it."""

    def __init__(self, session: Session, start: int) -> None:
        """``start``: the steps done before this session (a resumed run's)."""
        self._session = session
        self._start = start
        self._candidates = session.plan.candidates
        self._times: dict[int, list[float]] = {}
        self._needed = len(self._candidates) * STEPS_EACH
        self.active = bool(self._candidates)
        left = session.config.run.steps - start
        if self.active and left <= self._needed:
            self.active = False
            session.output.say(
                f"--microbatches auto: {left} step{'' if left == 1 else 's'} left, but trying "
                f"{len(self._candidates)} counts takes {self._needed} and one to train on: "
                f"training with {session.config.pipeline.microbatches} micro-batches "
                f"(more --steps to probe)"
            )

    def before(self, step: int) -> None:
        """Before ``step`` (0-based): switch to the count whose turn begins there."""
        turn, offset = divmod(step - self._start, STEPS_EACH)
        if self.active and offset == 0 and turn < len(self._candidates):
            self._use(self._candidates[turn].lowered)

    def after(self, step: int, elapsed: float) -> None:
        """After ``step``, which took ``elapsed`` seconds here: note it; after the last
        step of the probe, decide (a collective: every rank calls this at every step)."""
        index = step - self._start
        if not self.active or index >= self._needed:
            return
        count = self._session.pipeline.schedule.microbatches
        self._times.setdefault(count, []).append(elapsed)
        if index == self._needed - 1:
            self._decide(first_step=self._start + 1, last_step=step + 1)

    def settled(self) -> Session:
        """The session with the plan and config of the count the pipeline runs now (what
        the summary, the memory check and the pictures describe)."""
        session = self._session
        running = session.pipeline.schedule
        found = [c for c in self._candidates if c.lowered is running]
        if not found:
            return session
        prepared = found[0]
        p = dataclasses.replace(
            session.config.pipeline, microbatches=prepared.schedule.microbatches
        )
        return dataclasses.replace(
            session,
            plan=dataclasses.replace(session.plan, prepared=prepared),
            config=dataclasses.replace(session.config, pipeline=p),
        )

    # ----------------------------------------------------------------- inside
    def _use(self, lowered: Any) -> None:
        if self._session.pipeline.schedule is not lowered:
            self._session.pipeline.reschedule(lowered)

    def _decide(self, *, first_step: int, last_step: int) -> None:
        session = self._session
        counts = [c.schedule.microbatches for c in self._candidates]
        agreed = self._slowest_rank([min(self._times[m]) for m in counts])
        times = dict(zip(counts, agreed, strict=True))
        chosen = choose(times, start=counts[0])
        self._use(next(c.lowered for c in self._candidates if c.schedule.microbatches == chosen))
        session.output.record(
            {
                "microbatches_auto": {
                    "tried": {str(m): times[m] for m in sorted(times)},
                    "chosen": chosen,
                    "steps": [first_step, last_step],
                }
            }
        )
        tried = ", ".join(f"{times[m]:.3f} s at {m}" for m in sorted(times))
        session.output.say(
            f"--microbatches auto: step time {tried} (steps {first_step}-{last_step}): "
            f"training on with {chosen} micro-batches"
        )

    def _slowest_rank(self, times: list[float]) -> list[float]:
        """Each count's time on the slowest rank, the same list on every rank."""
        session = self._session
        group = session.mesh.world_group if session.mesh is not None else session.group
        if group is None:
            return times
        box = torch.tensor(times, dtype=torch.float64, device=session.device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=group)
        return [float(t) for t in box.tolist()]
