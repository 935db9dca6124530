"""How much of a CPU process's heap holes the order of its tensors explains.

Each layout is trained three times for the same steps on llama-default:

- as the trainer runs (glibc's heap kept, ``pipetrain.heap.keep_heap``): the resident peak,
  holes and all;
- with ``run.map_tensors``: the resident peak of the tensors' bytes alone;
- with ``--profile`` over every step and ``run.profile_memory``: every tensor allocation
  and free of each process, in order (torch.profiler's ``[memory]`` events).

Each process's tensor events are then replayed, alone, through this machine's glibc in a
fresh interpreter with the trainer's thresholds (``posix_memalign`` at 64 bytes, as c10's
CPU allocator; each free where the trace frees). The growth of the replayed heap over the
tensors' own peak is the holes that the tensors' order makes by itself; the rest of the
measured holes comes from what the replay leaves out (the interpreter's and autograd's
own allocations between the tensors, the heap as the run found it).

    .venv/bin/python benchmarks/heap_replay.py --out /tmp/heap_replay

Prints a table per process; BENCHMARKS.md has the figures (docs/memory_model.md reads them).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shlex
import subprocess
import sys
from pathlib import Path

_MIB = 2**20

# llama-default, batch 32 of 128 tokens: whole and split backwards, 2 and 4 processes.
LAYOUTS = (
    "--pp 1 --dp 2 --schedule 1f1b --microbatches 2",
    "--pp 2 --schedule 1f1b --microbatches 4 --no-early-grads",
    "--pp 2 --schedule chimera --microbatches 2",
    "--pp 2 --schedule zb-h1 --microbatches 8",
    "--pp 2 --schedule zb-h2 --microbatches 4",
    "--pp 2 --schedule dualpipe-v --microbatches 4",
    "--pp 2 --dp 2 --schedule v-half --microbatches 1",
    "--pp 4 --schedule 1f1b --microbatches 8",
)


def train_layout(
    flags: str, out: Path, name: str, steps: int, extra: list[str],
    env: dict[str, str] | None = None, timeout: float = 900,
) -> dict[str, list[float]]:  # fmt: skip
    """One run of the layout on llama-default (``env``: the processes' environment, None =
    this one's); its memory check (predicted and measured per process). The processes run
    glibc's malloc, whose heap these scripts study, unless ``extra`` sets run.allocator."""
    command = [sys.executable, "-m", "pipetrain.cli", "train", "--model", "llama-default",
               *shlex.split(flags), "--steps", str(steps), "--name", name,
               "--set", f"run.out_dir={out}", "--set", "run.allocator=system", *extra]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=timeout,
                   env=env)  # fmt: skip
    lines = (out / name / "metrics.jsonl").read_text().splitlines()
    return next(r for r in map(json.loads, lines) if r.get("memory_check"))


def _tensor_events(trace: Path) -> list[tuple[int, int]]:
    """(address, bytes: + allocated, - freed) of the process's CPU tensors, in order."""
    events = json.loads(trace.read_text())["traceEvents"]
    memory = [
        e for e in events
        if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0
    ]  # fmt: skip
    memory.sort(key=lambda e: (e["ts"], e["args"].get("Ev Idx", 0)))
    return [(int(e["args"]["Addr"]), int(e["args"]["Bytes"])) for e in memory]


def _tensor_peak(events: list[tuple[int, int]]) -> int:
    """The most tensor bytes live at once, over what was live when recording began."""
    level = peak = 0
    for _, size in events:
        level += size
        peak = max(peak, level)
    return peak


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]  # fmt: skip


def replay(events_file: Path) -> int:
    """In this (fresh) process: the events through glibc; the heap's largest growth."""
    from pipetrain.heap import keep_heap

    keep_heap()  # the thresholds the trainer's processes run with
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                    ctypes.c_size_t]  # fmt: skip
    libc.free.argtypes = [ctypes.c_void_p]

    def extent() -> int:
        info = libc.mallinfo2()
        return int(info.arena + info.hblkhd)

    start = extent()
    peak = 0
    live: dict[int, int] = {}
    for address, size in json.loads(events_file.read_text()):
        if size > 0:
            block = ctypes.c_void_p()
            if libc.posix_memalign(ctypes.byref(block), 64, size) != 0:
                raise MemoryError(size)
            live[address] = int(block.value or 0)
            peak = max(peak, extent() - start)
        elif address in live:  # a tensor from before the recording is no heap of ours
            libc.free(live.pop(address))
    return peak


def _replayed(events: list[tuple[int, int]], scratch: Path) -> int:
    scratch.write_text(json.dumps(events))
    done = subprocess.run(
        [sys.executable, __file__, "--replay", str(scratch)],
        check=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return int(done.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/heap_replay"))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layout", action="append", help="train flags (default: LAYOUTS)")
    parser.add_argument("--replay", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replay:
        print(replay(args.replay))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    print(
        "| layout | process | count | tensors (mapped) | measured (heap kept) | holes "
        "| replayed holes | explained |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for i, flags in enumerate(args.layout or LAYOUTS):
        kept = train_layout(flags, args.out, f"kept-{i}", args.steps, [])
        mapped = train_layout(flags, args.out, f"mapped-{i}", args.steps,
                        ["--set", "run.map_tensors=true"])  # fmt: skip
        train_layout(flags, args.out, f"traced-{i}", args.steps,
               ["--profile", f"1-{args.steps}", "--set", "run.profile_memory=true"])  # fmt: skip
        for rank, measured in enumerate(kept["measured_peak"]):
            events = _tensor_events(args.out / f"traced-{i}" / "profile" / f"rank{rank}.trace.json")
            made = _replayed(events, args.out / "events.json") - _tensor_peak(events)
            holes = measured - mapped["measured_peak"][rank]
            count = kept["predicted_peak"][rank] if kept["predicted_peak"] else float("nan")
            print(
                f"| {flags} | {rank} | {count / _MIB:.1f} | "
                f"{mapped['measured_peak'][rank] / _MIB:.1f} | {measured / _MIB:.1f} | "
                f"{holes / _MIB:.1f} | {made / _MIB:.1f} | "
                f"{made / holes if holes > 0 else float('nan'):.0%} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
