"""Faults of a small `pipetrain train` run, timed: what happens, how long it takes, what
is kept. The rows of the README's fault table (Reliability) come from here.

Each fault runs llama-tiny with --pp 2 (3 for the stopped rank) on a small corpus in a
temporary folder, one thread per rank, a checkpoint every step. A "long step" is rank 1's
third step turned into a ten-minute op (SIGTERM blocked in its main thread and a sleep,
injected by a sitecustomize module), as one long op in C would be. Times are seconds from
the fault to the end of the last process of the run (or to the second run's refusal).

    .venv/bin/python benchmarks/bench_faults.py
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

FLAGS = [
    "--model", "llama-tiny", "--steps", "100000", "--seq-len", "16",
    "--set", "optim.warmup_steps=0", "--set", "run.evaluate=false",
    "--set", "run.sample_tokens=0", "--set", "pipeline.threads=1", "--data", "data",
    "--checkpoint-dir", "ck", "--checkpoint-every", "1",
]  # fmt: skip

SITE = textwrap.dedent(
    """
    import os
    fault = os.environ.get("FAULT", "")
    if fault and os.environ.get("RANK") == os.environ["FAULT_RANK"]:
        import signal, time
        from pathlib import Path
        from pipetrain.runtime.api import Pipeline
        step, calls = Pipeline.step, []
        def faulty(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                Path(os.environ["FAULT_AT"]).write_text(str(os.getpid()))
                if fault == "long":
                    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
                    time.sleep(600)
                elif fault == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
            return step(self, *args, **kwargs)
        Pipeline.step = faulty
    """
)


def _tree(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        children = [p for p, parent in parents.items() if parent == current]
        found += children
        frontier += children
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Run:
    """One `pipetrain train` in ``folder`` (its own session), with a fault injected."""

    def __init__(self, folder: Path, name: str, flags: list[str], fault: str = "", rank: int = 1):
        self.folder = folder
        self.fault_at = folder / f"{name}.fault"
        env = dict(
            os.environ, PYTHONPATH=str(folder), FAULT=fault, FAULT_RANK=str(rank),
            FAULT_AT=str(self.fault_at),
        )  # fmt: skip
        self.err = folder / f"{name}.err"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipetrain.cli", "train", *FLAGS, *flags, "--name", name],
            cwd=folder, stdout=subprocess.DEVNULL, stderr=self.err.open("w"),
            start_new_session=True, env=env,
        )  # fmt: skip
        self.metrics = folder / "runs" / name / "metrics.jsonl"

    def wait_for_steps(self, steps: int) -> None:
        deadline = time.monotonic() + 300
        while not (self.metrics.exists() and self.metrics.read_text().count('"loss"') >= steps):
            assert self.proc.poll() is None, self.err.read_text()[-2000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)

    def wait_for_fault(self) -> None:
        while not self.fault_at.exists():
            assert self.proc.poll() is None, self.err.read_text()[-2000:]
            time.sleep(0.1)
        time.sleep(1.0)

    def ended_after(self, since: float, pids: list[int]) -> float:
        while any(_alive(pid) for pid in pids) or (
            _alive(self.proc.pid) and self.proc.poll() is None
        ):
            if time.monotonic() - since > 300:
                raise AssertionError("still running 300 s after the fault")
            time.sleep(0.05)
        return time.monotonic() - since

    def last_line(self) -> str:
        lines = self.err.read_text().strip().splitlines()
        return lines[-1] if lines else ""

    def kept(self) -> str:
        ck = self.folder / "ck"
        names = sorted(p.name for p in ck.iterdir()) if ck.exists() else []
        steps = [n for n in names if n.startswith("step_")]
        other = [n for n in names if not n.startswith("step_")]
        return f"{len(steps)} checkpoints, the newest {steps[-1] if steps else '-'}" + (
            f"; also {', '.join(other)}" if other else ""
        )

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def _folder(root: Path, name: str) -> Path:
    folder = root / name
    (folder / "data").mkdir(parents=True)
    rng = random.Random(0)
    words = ["def", "class", "return", "import", "for", "while", "if", "lambda", "self", "x"]
    for i in range(8):
        text = "\n".join(" ".join(rng.choice(words) for _ in range(10)) for _ in range(60))
        (folder / "data" / f"doc{i}.txt").write_text(text)
    (folder / "sitecustomize.py").write_text(SITE)
    return folder


PP2 = ["--pp", "2", "--batch-size", "4", "--microbatches", "2"]


def launcher_killed(root: Path, fault: str) -> tuple[str, float, str, str]:
    run = Run(_folder(root, f"killed-{fault or 'short'}"), "run", PP2, fault)
    run.wait_for_fault() if fault else run.wait_for_steps(3)
    pids = _tree(run.proc.pid)
    start = time.monotonic()
    run.proc.kill()
    run.proc.wait()
    took = run.ended_after(start, pids)
    return (f"launcher SIGKILLed, {fault or 'short'} step", took, run.kept(), "")


def sigterm(root: Path, fault: str) -> tuple[str, float, str, str]:
    run = Run(_folder(root, f"term-{fault or 'short'}"), "run", PP2, fault)
    run.wait_for_fault() if fault else run.wait_for_steps(3)
    start = time.monotonic()
    os.killpg(run.proc.pid, signal.SIGTERM)
    run.proc.wait()
    took = run.ended_after(start, [])
    return (f"SIGTERM, {fault or 'short'} step", took, run.kept(), run.last_line())


def port_clash(root: Path) -> tuple[str, float, str, str]:
    folder = _folder(root, "clash")
    with socket_port() as port:
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
        first = [by_hand(folder, "first", rank, env) for rank in (0, 1)]
        try:
            metrics = folder / "runs" / "first" / "metrics.jsonl"
            while not (metrics.exists() and '"loss"' in metrics.read_text()):
                time.sleep(0.2)
            start = time.monotonic()
            second = [by_hand(folder, "second", rank, env) for rank in (0, 1)]
            codes = [p.wait() for p in second]
            took = time.monotonic() - start
            assert all(p.poll() is None for p in first)
        finally:
            for p in first:
                os.killpg(p.pid, signal.SIGKILL)
    line = (folder / "second1.err").read_text().strip().splitlines()[-1]
    return (f"second run on a taken port (exit {codes})", took, "first run untouched", line)


@contextlib.contextmanager
def socket_port():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from local_port import reserved_port

    with reserved_port() as port:
        yield port


def by_hand(folder: Path, name: str, rank: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "pipetrain.cli", "train", *FLAGS[:-4], *PP2, "--name", name],
        cwd=folder, stdout=subprocess.DEVNULL, stderr=(folder / f"{name}{rank}.err").open("w"),
        start_new_session=True,
        env={**os.environ, **env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
    )  # fmt: skip


def rank_stopped(root: Path) -> tuple[str, float, str, str]:
    flags = ["--pp", "3", "--batch-size", "6", "--microbatches", "3",
             "--set", "pipeline.timeout_s=5"]  # fmt: skip
    run = Run(_folder(root, "stopped"), "run", flags, "stop", rank=0)
    run.wait_for_fault()
    start = time.monotonic() - 1.0  # wait_for_fault slept a second after the stop
    run.proc.wait()
    took = run.ended_after(start, [])
    return ("rank 0 SIGSTOPped (--pp 3, timeout_s 5)", took, run.kept(), run.last_line())


def main() -> None:
    print(f"load: {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rows = []
        for measure in (
            lambda: launcher_killed(root, "long"),
            lambda: launcher_killed(root, ""),
            lambda: sigterm(root, "long"),
            lambda: sigterm(root, ""),
            lambda: port_clash(root),
            lambda: rank_stopped(root),
        ):
            rows.append(measure())
            what, took, kept, line = rows[-1]
            print(f"| {what} | {took:.1f} s | {kept} | {line}", flush=True)


if __name__ == "__main__":
    main()
