"""pipetrain.heap's allocators: which one a process runs with, the library a run preloads
(``run.allocator``), how the launcher's LD_PRELOAD is composed, and that each allocator's
free pages are given back before a run's baseline."""

from __future__ import annotations

import ctypes.util
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from pipetrain.config.errors import ConfigError
from pipetrain.config.load import load_config
from pipetrain.config.schema import TrainConfig
from pipetrain.heap import (
    allocator_library,
    preloading,
    running_allocator,
    setup_line,
    with_preload,
)
from pipetrain.launch.local import rank_preload

ROOT = Path(__file__).resolve().parents[2]
_GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _found(name: str) -> str:
    try:
        return allocator_library(name)
    except LookupError:
        return ""


@pytest.mark.skipif(not _GLIBC, reason="glibc's malloc")
def test_this_process_runs_glibc() -> None:
    assert running_allocator() == "glibc"


# In a fresh interpreter with the library preloaded: what it runs with, that its free
# pages go back (the resident set shrinks after a freed block), and that glibc's
# thresholds are left alone.
_PROBE = """
import ctypes, sys
sys.path.insert(0, {root!r})
from pipetrain.heap import keep_heap, release_free_heap, running_allocator
def rss():
    line = next(l for l in open("/proc/self/status") if l.startswith("VmRSS:"))
    return int(line.split()[1])
this = ctypes.CDLL(None)
this.malloc.restype = ctypes.c_void_p
this.free.argtypes = [ctypes.c_void_p]
blocks = [this.malloc(1 << 20) for _ in range(64)]
for b in blocks:
    ctypes.memset(b, 1, 1 << 20)
for b in blocks:
    this.free(b)
held = rss()
print(running_allocator(), release_free_heap(), keep_heap(), held - rss())
"""


@pytest.mark.parametrize("name", ["tcmalloc", "jemalloc"])
def test_a_preloaded_allocator_is_named_and_gives_pages_back(name: str) -> None:
    library = _found(name)
    if not _GLIBC or not library:
        pytest.skip(f"{name} is not installed")
    code = _PROBE.format(root=str(ROOT))
    env = {"LD_PRELOAD": library, "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    ).stdout.split()
    assert out[:3] == [name, "True", "False"], out
    assert int(out[3]) > 32 * 1024, out  # KiB: most of the 64 MiB freed went back


def test_allocator_library_by_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert allocator_library("system") == ""
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    assert allocator_library("auto") == ""  # the C library's own, without a word
    with pytest.raises(LookupError, match=r"apt install libtcmalloc-minimal4"):
        allocator_library("tcmalloc")
    with pytest.raises(LookupError, match="apt install libjemalloc2"):
        allocator_library("jemalloc")
    assert setup_line().endswith("(Debian: apt install libtcmalloc-minimal4)")
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: f"lib{name}.so.9")
    if platform.system() == "Linux":
        assert setup_line() == "CPU runs preload libtcmalloc_minimal.so.9 (run.allocator=auto)"
        assert allocator_library("auto") == "libtcmalloc_minimal.so.9"
        assert allocator_library("jemalloc") == "libjemalloc.so.9"


def test_preload_goes_first_and_keeps_a_users_allocator() -> None:
    tc = "libtcmalloc_minimal.so.4"
    assert with_preload(tc, "") == tc
    assert with_preload(tc, "/opt/libtrace.so") == f"{tc} /opt/libtrace.so"
    assert with_preload(tc, "/usr/lib/libjemalloc.so.2") == "/usr/lib/libjemalloc.so.2"
    assert with_preload(tc, "a.so:/x/libmimalloc.so") == "a.so:/x/libmimalloc.so"
    assert with_preload("", "a.so") == "a.so"


def _config(**sections: dict[str, object]) -> TrainConfig:
    """A config of 2 pipeline ranks with these fields, by section (``run={...}``)."""
    overrides = {f"{section}.{key}": v for section, f in sections.items() for key, v in f.items()}
    return load_config(None, {"pipeline.pp": 2, **overrides}, check_paths=False, default_name="t")


def test_rank_preload_on_cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: f"lib{name}.so.9")
    if platform.system() != "Linux":
        pytest.skip("LD_PRELOAD is Linux's")
    assert rank_preload(_config(pipeline={"device": "cpu"})) == "libtcmalloc_minimal.so.9"
    assert rank_preload(_config(pipeline={"device": "cuda"})) == ""
    assert rank_preload(_config(pipeline={"device": "cpu"}, run={"map_tensors": True})) == ""
    assert rank_preload(_config(pipeline={"device": "cpu"}, run={"allocator": "system"})) == ""
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    with pytest.raises(ConfigError, match=r"install it or --set run\.allocator=auto"):
        rank_preload(_config(pipeline={"device": "cpu"}, run={"allocator": "jemalloc"}))


def test_allocator_setting_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"use one of auto, tcmalloc, jemalloc, system"):
        _config(run={"allocator": "libc"})
    with pytest.raises(ConfigError, match=r"run\.map_tensors maps tensors through glibc"):
        _config(run={"map_tensors": True, "allocator": "jemalloc"})


def test_preloading_sets_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LD_PRELOAD", "/opt/libtrace.so")
    with preloading("libtcmalloc_minimal.so.4"):
        assert os.environ["LD_PRELOAD"] == "libtcmalloc_minimal.so.4 /opt/libtrace.so"
    assert os.environ["LD_PRELOAD"] == "/opt/libtrace.so"
    monkeypatch.delenv("LD_PRELOAD")
    with preloading(""):
        assert "LD_PRELOAD" not in os.environ
    with pytest.raises(KeyError), preloading("libjemalloc.so.2"):
        assert os.environ["LD_PRELOAD"] == "libjemalloc.so.2"
        raise KeyError
    assert "LD_PRELOAD" not in os.environ
