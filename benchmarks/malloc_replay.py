"""What a CPU process's heap holes come from: every malloc of a training run, replayed.

``heap_replay.py`` replays a process's tensors alone and finds that their order makes a
third of the heap's holes. This script records every allocation instead: each layout of
llama-default is trained with glibc's malloc tracer (``libc_malloc_debug.so`` preloaded,
``mtrace`` started in each process right after the trainer fixes its heap thresholds), and
each process's allocations and frees in the main heap are then replayed through this
machine's glibc in a fresh interpreter, with the trainer's thresholds:

- every allocation, in order: if the replay's heap grows as the run's resident set did,
  the holes are the allocations' order and nothing else (no page the kernel kept, no
  allocator state the trace misses);
- the same with every allocation under 1 KiB left out, as an allocator that keeps small
  objects apart from large ones would (jemalloc's and tcmalloc's size classes): what the
  small objects' placement between the tensors costs.

A second run of each layout with ``run.map_tensors`` gives the tensors' own bytes.

    .venv/bin/python benchmarks/malloc_replay.py --out /tmp/malloc_replay

The traced runs are slow (every malloc is written out: minutes a layout). Prints a table per
process; BENCHMARKS.md has the figures.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
from pathlib import Path

from heap_replay import MallInfo2, train_layout

_MIB = 2**20
_SMALL = 1024
_DEBUG_MALLOC = "/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0"

LAYOUTS = (
    "--pp 2 --schedule zb-h2 --microbatches 4",
    "--pp 2 --schedule 1f1b --microbatches 4 --no-early-grads",
)

# Imported by every Python process of the traced run (PYTHONPATH): starts glibc's tracer in
# the process right after the trainer's keep_heap, where the memory check's count begins
# (the baseline is taken after the model is built, and the weights are added back).
_SITE = """
import ctypes, importlib.util, os, sys

def _trace() -> None:
    os.environ["MALLOC_TRACE"] = os.path.join(
        os.environ["MALLOC_REPLAY_DIR"], "trace." + os.environ.get("RANK", "0"))
    libc = ctypes.CDLL(None)
    find = libc.dlvsym  # mtrace is a compatibility symbol of the debug library only
    find.restype = ctypes.c_void_p
    find.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p]
    debug = ctypes.CDLL("libc_malloc_debug.so.0")
    ctypes.CFUNCTYPE(None)(find(debug._handle, b"mtrace", b"GLIBC_2.2.5"))()

class _Hook:
    def find_spec(self, name, path, target=None):
        if name != "pipetrain.heap":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            keep = module.keep_heap

            def keep_heap(*args, **kwargs):
                done = keep(*args, **kwargs)
                _trace()
                return done

            module.keep_heap = keep_heap

        spec.loader.exec_module = exec_module
        return spec

if os.environ.get("MALLOC_REPLAY_DIR"):
    sys.meta_path.insert(0, _Hook())
"""


def _events(trace: Path, events: Path, smallest: int) -> int:
    """The trace's main-heap allocations of ``smallest`` bytes and more, and their frees, as
    lines ``a <id> <bytes> <alignment>`` / ``f <id>``; how many allocations."""
    ids: dict[int, int] = {}
    count = 0
    with trace.open() as lines, events.open("w") as out:
        for line in lines:
            # "@ caller + address size" (malloc), "- address" (free), "< address" and
            # "> address size" (a realloc's free and allocation).
            field = line.split()
            if len(field) < 4 or field[0] != "@":
                continue
            op, address = field[2], int(field[3], 16)
            # The main arena's heap lies just above the executable, far below the mmap
            # area (x86-64's layout): thread arenas and mapped blocks are not its holes.
            if address >= 0x7000_0000_0000:
                continue
            if op in "+>":
                size = int(field[4], 16)
                if size < smallest:
                    continue
                count += 1
                ids[address] = count
                aligned = 64 if "alloc_cpu" in field[1] else 0  # c10's posix_memalign
                out.write(f"a {count} {size} {aligned}\n")
            elif (number := ids.pop(address, None)) is not None:
                out.write(f"f {number}\n")
    return count


def replay(events: Path, count: int) -> int:
    """In this (fresh) process: the events through glibc with the trainer's thresholds; the
    main heap's largest growth."""
    from pipetrain.heap import keep_heap

    blocks = (ctypes.c_void_p * (count + 1))()  # allocated once, before the replay starts
    keep_heap()
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                    ctypes.c_size_t]  # fmt: skip
    libc.free.argtypes = [ctypes.c_void_p]
    start = peak = libc.mallinfo2().arena
    with events.open() as lines:
        for line in lines:
            field = line.split()
            number = int(field[1])
            if field[0] == "f":
                libc.free(blocks[number])
                continue
            size = int(field[2])
            if field[3] != "0":
                block = ctypes.c_void_p()
                if libc.posix_memalign(ctypes.byref(block), 64, size) != 0:
                    raise MemoryError(size)
                blocks[number] = block.value
            else:
                blocks[number] = libc.malloc(size)
            # The heap grows only by a large allocation or by many small ones.
            if size >= 65536 or number % 64 == 0:
                peak = max(peak, libc.mallinfo2().arena)
    return int(peak - start)


def _replayed(trace: Path, smallest: int) -> int:
    events = trace.with_suffix(f".events{smallest}")
    count = _events(trace, events, smallest)
    done = subprocess.run(
        [sys.executable, __file__, "--replay", str(events), "--count", str(count)],
        check=True, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    return int(done.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/malloc_replay"))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layout", action="append", help="train flags (default: LAYOUTS)")
    parser.add_argument("--replay", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replay:
        print(replay(args.replay, args.count))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    site = args.out / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITE)
    print(
        "| layout | process | count | tensors (mapped) | measured (heap kept, traced) "
        "| replayed, every allocation | replayed, under 1 KiB apart |"
    )
    print("|---|---|---|---|---|---|---|")
    for i, flags in enumerate(args.layout or LAYOUTS):
        traces = args.out / f"traces-{i}"
        traces.mkdir(exist_ok=True)
        paths = [str(site), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        env = dict(os.environ, LD_PRELOAD=_DEBUG_MALLOC, MALLOC_REPLAY_DIR=str(traces),
                   PYTHONPATH=os.pathsep.join(paths))  # fmt: skip
        kept = train_layout(flags, args.out, f"traced-{i}", args.steps, [], env, timeout=3600)
        mapped = train_layout(flags, args.out, f"mapped-{i}", args.steps,
                        ["--set", "run.map_tensors=true"])  # fmt: skip
        for rank, measured in enumerate(kept["measured_peak"]):
            trace = traces / f"trace.{rank}"
            every, apart = _replayed(trace, 0), _replayed(trace, _SMALL)
            count = kept["predicted_peak"][rank] if kept["predicted_peak"] else float("nan")
            print(
                f"| {flags} | {rank} | {count / _MIB:.1f} | "
                f"{mapped['measured_peak'][rank] / _MIB:.1f} | {measured / _MIB:.1f} | "
                f"{every / _MIB:.1f} | {apart / _MIB:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
