"""What a user meets around ``simulate``: every refusal of the registry's sizes, the ASCII
grid's width, pictures and traces that cannot be written, and schedule files saved by
spreadsheets, binary or runaway files and hand-written JSON params."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipetrain.schedules import ScheduleError, registry
from pipetrain.schedules.io import dump_csv, dump_json, load_csv, load_json
from pipetrain.sim.costs import CostsError, parse_costs
from pipetrain.sim.render import RenderError, plot, text_grid, write_chrome_trace
from pipetrain.sim.simulator import SimResult, simulate


def _sizes(p: int) -> list[int]:
    return sorted({1, max(p - 1, 1), p, 2 * p + 1, 32})


def test_every_refusal_of_the_registry_is_one_line_naming_a_flag() -> None:
    refused = 0
    for name in registry.SCHEDULE_NAMES:
        spec = registry.get_spec(name)
        for p in (1, 2, 3, 4, 8):
            for m in _sizes(p):
                for v in (None, 1, 3) if spec.uses_chunks else (None,):
                    reason = spec.check(p, m, v)
                    if reason is None:
                        continue
                    refused += 1
                    assert "\n" not in reason, (name, p, m, v)
                    assert "--" in reason, (name, p, m, v, reason)
                    # "use 2 or 2" offers one fix twice (Chimera at p = 1 did).
                    assert not re.search(r"\buse (\d+) or \1\b", reason), reason
    assert refused > 50  # the sweep reaches the constraints, not only the easy sizes


@pytest.fixture(scope="module")
def long_runs() -> list[SimResult]:
    """m = 64 on 4 ranks: far wider than a terminal, so every grid is squeezed."""
    return [simulate(registry.build_schedule(n, 4, 64)) for n in ("1f1b", "zb-v", "gpipe")]


@pytest.mark.parametrize("width", [20, 57, 120])
def test_squeezed_grid_and_its_ruler_stay_within_the_width(
    long_runs: list[SimResult], width: int
) -> None:
    for result in long_runs:
        lines = text_grid(result.timeline, width=width).splitlines()
        # The header and the chunk legend are text; the ruler and the rows are the grid.
        grid = [line for line in lines[1:] if not line.startswith("(squeezed")]
        assert len(grid) == 1 + result.num_ranks
        assert max(len(line) for line in grid) <= width, (result.schedule, width)


def test_unwritable_trace_and_picture_are_one_line_errors(tmp_path: Path) -> None:
    tl = simulate(registry.build_schedule("1f1b", 2, 2)).timeline
    missing = tmp_path / "no" / "such" / "dir"
    with pytest.raises(RenderError, match=r"cannot write .*trace\.json.*: pick a writable"):
        write_chrome_trace(tl, missing / "trace.json")
    with pytest.raises(RenderError, match="Is a directory"):
        write_chrome_trace(tl, tmp_path)
    folder = tmp_path / "picture.png"
    folder.mkdir()
    with pytest.raises(RenderError, match=r"cannot write .*picture\.png"):
        plot(tl, folder)


@pytest.fixture(scope="module")
def gpipe_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("files")
    built = registry.build_schedule("gpipe", 2, 2)
    dump_csv(built, root / "g.csv")
    dump_json(built, root / "g.json")
    return root / "g.csv", root / "g.json"


def test_a_byte_order_mark_from_a_spreadsheet_is_accepted(
    tmp_path: Path, gpipe_files: tuple[Path, Path]
) -> None:
    for path, load in zip(gpipe_files, (load_csv, load_json), strict=True):
        marked = tmp_path / f"excel{path.suffix}"
        marked.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
        assert load(marked).actions == load(path).actions


def message(path: Path, data: str | bytes) -> str:
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)
    load = load_json if path.suffix == ".json" else load_csv
    with pytest.raises(ScheduleError) as info:
        load(path)
    text = str(info.value)
    assert "\n" not in text
    return text


def test_binary_huge_and_deep_files_are_short_one_line_errors(tmp_path: Path) -> None:
    binary = message(tmp_path / "s.csv", b"\x7fELF\x02\x01\x01\x00\xd0\xff" * 20)
    assert "is not UTF-8 text" in binary and "check the path" not in binary
    # A quote that is never closed swallows the rest of the file into one cell, over the
    # csv module's 128 KiB field limit.
    runaway = message(tmp_path / "s.csv", '0F0,"0B0\n' + "1F0,1B0\n" * 20_000)
    assert "row 1" in runaway and "not a CSV of actions" in runaway
    long_cell = message(tmp_path / "s.csv", "0F0," + "x" * 5000 + "\n")
    assert "row 1, column 2" in long_cell and "(5000 characters)" in long_cell
    assert len(long_cell) < 300
    # Columns aligned with wide padding are still fine.
    (tmp_path / "wide.csv").write_text(f"{'0F0':>50},{'0B0':<50}\n")
    assert load_csv(tmp_path / "wide.csv").num_ranks == 1
    deep = message(tmp_path / "s.json", "[" * 100_000 + "]" * 100_000)
    assert "nested too deeply" in deep


def test_a_blank_row_between_ranks_is_refused_not_an_idle_rank(tmp_path: Path) -> None:
    # It used to load as pp=3 with rank 1 idle, and every later rank shifted by one.
    text = message(tmp_path / "s.csv", "0F0,0B0\n\n1F0,1B0\n")
    assert "row 2 (rank 1) has no actions" in text and "remove the blank row" in text
    assert "row 1 (rank 0)" in message(tmp_path / "s.csv", " , \n0F0,0B0\n1F0,1B0\n")
    # Blank lines after the last rank are still fine.
    (tmp_path / "t.csv").write_text("0F0,0B0\n1F0,1B0\n\n\n")
    assert load_csv(tmp_path / "t.csv").num_ranks == 2


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"steps": 0}, "param 'steps' must be a whole number >= 1, got 0"),
        ({"window": -2}, "param 'window' must be a whole number >= 1, got -2"),
        ({"window": True}, "param 'window' must be a whole number >= 1, got True"),
        ({"windw": 2}, "unknown param 'windw'"),
        ({"v": 2}, "param 'v' is 2 but the placement puts 1 stage(s) on each rank"),
        ({"window": 1, "steps": 1}, "window=1 x steps=1 must equal 'microbatches' (2)"),
    ],
)
def test_json_params_are_checked(
    tmp_path: Path, gpipe_files: tuple[Path, Path], params: dict[str, int], expected: str
) -> None:
    doc = json.loads(gpipe_files[1].read_text())
    assert expected in message(tmp_path / "p.json", json.dumps({**doc, "params": params}))


def test_json_params_of_the_generators_still_load(tmp_path: Path) -> None:
    for name, p, m in (("pipedream-2bw", 2, 2), ("interleaved-1f1b", 2, 4)):
        built = registry.build_schedule(name, p, m)
        dump_json(built, tmp_path / "s.json")
        assert load_json(tmp_path / "s.json").params == built.params


@pytest.mark.parametrize(
    ("text", "b", "i", "w"),
    [
        ("B=4,W=0.5", 4.0, 3.5, 0.5),
        ("B=4,I=3", 4.0, 3.0, 1.0),
        ("I=2", 3.0, 2.0, 1.0),
        ("W=0.5", 1.5, 1.0, 0.5),
        ("B=3,I=1,W=2", 3.0, 1.0, 2.0),
        ("B=4/2,I=1", (4.0, 2.0), 1.0, (3.0, 1.0)),
    ],
)
def test_any_subset_of_b_i_w_describes_one_backward(
    text: str, b: object, i: object, w: object
) -> None:
    # A split-backward schedule (I, W) and a plain one (B) are compared on one model only
    # when B = I + W: "B=4,W=0.5" once left I at 1 and ZB-H1 looked twice as fast as 1F1B.
    c = parse_costs(text)
    assert (c.backward, c.backward_input, c.backward_weight) == (b, i, w)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("B=4,I=1,W=1", "B must equal I + W"),
        ("B=2,I=3", "I is longer than B"),
        ("B=1/1,W=0.5/2", "W is longer than B"),
        ("B=1/1,I=1/1/1", "B and I give different numbers of stages"),
    ],
)
def test_a_backward_that_does_not_add_up_is_refused(text: str, expected: str) -> None:
    with pytest.raises(CostsError, match="--costs") as info:
        parse_costs(text)
    assert expected in str(info.value) and "\n" not in str(info.value)
