"""The training loop's side of checkpoints: resume, periodic saves, and a graceful stop.

The loop makes three calls: ``resume()`` once before the first step (the step to start
from), ``after_step(step)`` after every optimizer step (True: stop now), and ``close()``.
SIGTERM or SIGINT only sets a flag; at the end of the step in progress every rank learns
whether any rank got one (an all-reduce of the flag), all save together and stop, so a
preempted job loses at most the step it was in. A second SIGINT, a moment after the
first, interrupts at once.
"""

from __future__ import annotations

import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.checkpoint.comm import Comm, jsonable
from pipetrain.checkpoint.directory import CheckpointList, list_checkpoints
from pipetrain.checkpoint.errors import CheckpointError
from pipetrain.checkpoint.load import LoadResult, resume_checkpoint
from pipetrain.checkpoint.manifest import Layout
from pipetrain.checkpoint.save import save_checkpoint
from pipetrain.checkpoint.space import megabytes, optimizer_bytes, plan_room, tensor_bytes
from pipetrain.checkpoint.state import index_parameters, model_entries
from pipetrain.errors import on_every_rank
from pipetrain.launch.guard import StopGrace

__all__ = [
    "CheckpointPolicy",
    "RunCheckpoints",
    "StopSignal",
    "changed_settings",
    "earlier_checkpoints_error",
    "past_the_end_error",
]


@dataclass(frozen=True)
class CheckpointPolicy:
    directory: str = ""  # "" = no checkpoints
    every: int = 0  # save every this many optimizer steps (0: only at a stop and at the end)
    keep: int = 0  # complete checkpoints to keep (0: all)
    resume: bool = False  # continue from the newest valid checkpoint in ``directory``
    stop_grace_s: float = 20.0  # how long a step may finish after SIGTERM (launch.guard)

    def __post_init__(self) -> None:
        if self.every < 0:
            raise CheckpointError(f"checkpoint_every is {self.every}: use 0 (off) or more steps")
        if self.keep < 0:
            raise CheckpointError(f"keep is {self.keep}: use 0 (keep all) or more")
        if (self.resume or self.every) and not self.directory:
            what = "--resume" if self.resume else "--checkpoint-every"
            raise CheckpointError(f"{what} needs a directory: add --checkpoint-dir DIR")


# A Ctrl-C reaches every process of the terminal's group and the local launcher forwards
# it to its workers as well: a worker sees it twice at once. Only a second SIGINT later
# than this means "do not wait".
_REPEAT_AFTER_S = 1.0


class StopSignal:
    """SIGTERM/SIGINT set a flag instead of killing the process, while installed; after
    SIGTERM a step that has not ended within ``grace_s`` ends the process
    (``pipetrain.launch.guard.StopGrace``)."""

    def __init__(self, grace_s: float = 20.0) -> None:
        self._flag = False  # this rank or, once agreed, any rank was signalled
        # When this rank itself was first signalled (None: not yet). A stop learned from
        # another rank in the agreement is not a Ctrl-C here: this rank's own first one,
        # arriving any time later (another node's terminal, a scheduler signalling nodes
        # one by one), must not count as the second and abort the save in progress.
        self._first_at: float | None = None
        self._previous: dict[int, Any] = {}
        self._grace = StopGrace(grace_s)
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be installed from the main thread
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        self._grace.start()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self._first_at is None:
            self._first_at = now
        elif signum == signal.SIGINT and now - self._first_at > _REPEAT_AFTER_S:
            raise KeyboardInterrupt  # asked twice: do not wait for the step to end
        self._flag = True

    @property
    def local(self) -> bool:
        return self._flag

    def agreed(self, group: Any, device: torch.device) -> bool:
        """True on every rank when any rank of ``group`` was signalled (collective)."""
        if group is None:
            if self._flag:
                self._grace.release()  # the step ended: the save and the exit follow
            return self._flag
        flag = torch.tensor([1.0 if self._flag else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        agreed = bool(flag.item())
        # A signal that came during the all-reduce has its Python handler run when the call
        # returns, after ``flag`` was read. Overwriting the local flag with the reduced
        # value dropped it on every rank that waited there, and the run trained on until
        # the launcher's SIGKILL. Kept, it counts at the next step; the answer is the
        # reduced value, the same on every rank, so that all stop at one step.
        self._flag = self._flag or agreed
        if agreed:
            self._grace.release()  # the step ended: the save and the exit follow
        return agreed

    def close(self) -> None:
        self._grace.close()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


# The settings that decide which batches come next and what the optimizer makes of them.
# The layout (the pipeline section) and the run's bookkeeping may change on resume freely.
_TRAJECTORY = {"data": None, "optim": None, "run": ("steps", "seed")}


def earlier_checkpoints_error(
    directory: Path | str, found: CheckpointList | None = None
) -> CheckpointError | None:
    """The refusal of a run that does not resume but would save into ``directory``, which
    holds another run's checkpoints (``found``: its listing, when already made); None if
    it holds none."""
    found = list_checkpoints(directory) if found is None else found
    if not found.complete:
        return None
    step, newest = found.complete[-1]
    return CheckpointError(
        f"{directory} already holds checkpoints of an earlier run (the newest "
        f"{newest.name}, step {step}): add --resume to continue it, or pass another "
        "--checkpoint-dir (or remove those) to start over"
    )


def past_the_end_error(path: Path, step: int, total_steps: int) -> CheckpointError:
    """The refusal of a resume from ``path`` (at ``step``) by a run of ``total_steps``."""
    return CheckpointError(
        f"{path} is at step {step}, past this run's {total_steps} steps: "
        f"pass --steps {step + 1} or more to continue it, or another --checkpoint-dir"
    )


def changed_settings(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """``section.field old -> new`` for every trajectory setting of ``now`` that differs from
    the saved run config (sections the saved config lacks are not compared)."""
    out: list[str] = []
    for section, fields in _TRAJECTORY.items():
        before, after = saved.get(section), now.get(section)
        if not isinstance(before, Mapping) or not isinstance(after, Mapping):
            continue
        for name in fields or sorted(after):
            value = jsonable(after.get(name))  # as it would read back from the manifest
            if name in before and before[name] != value:
                out.append(f"{section}.{name} {before[name]!r} -> {value!r}")
    return out


class RunCheckpoints:
    """Checkpoints of one training run, as seen by one rank."""

    def __init__(
        self,
        policy: CheckpointPolicy,
        *,
        modules: Iterable[nn.Module],
        optimizer: torch.optim.Optimizer,
        model: Mapping[str, Any],
        layout: Layout,
        config: Mapping[str, Any],
        total_steps: int,
        group: Any,
        device: torch.device,
        say: Callable[[str], None] = lambda text: None,
        state: Callable[[int], Mapping[str, Any]] = lambda step: {},
    ) -> None:
        """``state(step)`` gives the JSON-able trainer state after ``step`` steps (data
        position, ...) to store with the checkpoint; ``say`` prints on the reporting rank."""
        self.policy = policy
        self._modules = tuple(modules)
        self._optimizer = optimizer
        self._model = dict(model)
        self._layout = layout
        self._config = dict(config)
        self._total = total_steps
        self._group = group
        self._device = device
        self._say = say
        self._state = state
        self._last_saved = -1
        self.stop = StopSignal(policy.stop_grace_s)
        self.stopped = False
        # A loop that dies of an exception never calls close(): the handlers go back when
        # this object is collected, so the process's Ctrl-C works again either way.
        self._release = weakref.finalize(self, self.stop.close)

    def resume(self) -> int:
        """The step to start from: 0, or that of the checkpoint loaded.

        Weights and optimizer state come from the checkpoint; the optimizer's settings
        (betas, eps, weight decay) stay this run's, as its config says."""
        self._warn_if_no_room()
        if not self.policy.resume:
            self._refuse_earlier_checkpoints()
            return 0
        # Loading an optimizer state dict also loads the saved run's settings, which would
        # quietly undo a changed --set optim.*; the learning rate is the schedule's at
        # every step either way.
        settings = [
            {name: value for name, value in group.items() if name != "params"}
            for group in self._optimizer.param_groups
        ]
        result: LoadResult | None = resume_checkpoint(
            self.policy.directory,
            modules=self._modules,
            optimizer=self._optimizer,
            model=self._model,
            group=self._group,
        )
        for group, own in zip(self._optimizer.param_groups, settings, strict=True):
            group.update(own)
        if result is None:
            self._say(f"no checkpoint in {self.policy.directory} yet: starting from step 0")
            return 0
        if result.step > self._total:
            # Nothing to train, and the summary would report the checkpoint's weights as
            # those "after" fewer steps than they had.
            raise on_every_rank(past_the_end_error(result.path, result.step, self._total))
        self._last_saved = result.step
        saved = result.manifest.layout
        self._say(
            f"resumed from {result.path} at step {result.step} in {result.seconds:.2f} s "
            f"(saved with pp={saved.pp}{f' tp={saved.tp}' if saved.tp > 1 else ''} "
            f"chunks={saved.chunks} schedule={saved.schedule})"
        )
        changed = changed_settings(result.manifest.config, self._config)
        if changed:
            # Not refused: a new LR or length is a choice; but a new grad_accum, batch or
            # seed also reads other batches than the saved run would have (some again).
            self._say(
                f"note: resuming with settings other than the saved run's ({', '.join(changed)}): "
                "the steps from here are not those of the run continued as it was"
            )
        return result.step

    def _warn_if_no_room(self) -> None:
        """Say at the start when a checkpoint of this run cannot fit in its directory (every
        rank counts what it will save; rank 0 compares): better now than after hours."""
        if not self.policy.directory:
            return
        comm = Comm.of(self._group)
        entries = model_entries(index_parameters(self._modules))
        mine = tensor_bytes(entries.values()) + optimizer_bytes(self._optimizer)
        sizes = comm.gather(mine)
        if comm.rank != 0:
            return
        root, keep = Path(self.policy.directory), self.policy.keep or None
        room = plan_room(root, self._total + 1, sum(sizes), keep)
        if room.fits:
            return
        pruned = f" ({megabytes(room.free + room.prunable)} with --keep {keep})" if keep else ""
        self._say(
            f"warning: a checkpoint of this run needs about {megabytes(room.needed)} but "
            f"{megabytes(room.free)} are free in {root}{pruned}: its saves will fail; free "
            "space there, pass --keep N, or another --checkpoint-dir"
        )

    def _refuse_earlier_checkpoints(self) -> None:
        """A run that does not resume must not save into a directory of another run's
        checkpoints: its step_N would replace theirs one by one (a forgotten --resume after
        a preemption would throw the progress away)."""
        if not self.policy.directory:
            return
        comm = Comm.of(self._group)
        found = comm.broadcast(list_checkpoints(self.policy.directory) if comm.rank == 0 else None)
        refusal = earlier_checkpoints_error(self.policy.directory, found)
        if refusal is not None:
            raise on_every_rank(refusal)  # rank 0's listing, broadcast

    def after_step(self, step: int) -> bool:
        """After ``step`` optimizer steps: save when due, and on a stop signal (then True)."""
        stop = self.stop.agreed(self._group, self._device)
        due = bool(self.policy.every) and step % self.policy.every == 0
        final = step == self._total
        if self.policy.directory and (due or stop or final) and step != self._last_saved:
            self.save(step)
        if stop:
            self.stopped = True
            self._say(f"stop signal: finished step {step} and stopped")
        return stop

    def save(self, step: int) -> Path:
        result = save_checkpoint(
            self.policy.directory,
            step,
            modules=self._modules,
            optimizer=self._optimizer,
            model=self._model,
            layout=self._layout,
            config=self._config,
            trainer=self._state(step),
            keep=self.policy.keep or None,
            group=self._group,
        )
        self._last_saved = step
        if result.made_room:
            self._say(
                f"note: made room for step {step} (about {megabytes(result.needed)}): removed "
                f"{', '.join(p.name for p in result.made_room)} before the save, as --keep "
                f"{self.policy.keep} would have after it"
            )
        self._say(
            f"saved checkpoint {result.path} ({result.bytes / 1e6:.1f} MB in {result.seconds:.2f} s)"
        )
        return result.path

    def close(self) -> None:
        self._release()
