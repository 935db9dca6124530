"""CSV and JSON files: round trips, hand-edited files, and one-line errors for bad input.

Files as users make them: saved by a spreadsheet (a byte-order mark), binary, runaway or
deeply nested files (short one-line errors), a blank row between ranks, and hand-written
JSON params checked while the generators' own still load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipetrain.schedules import ScheduleError, registry
from pipetrain.schedules.io import dump_csv, dump_json, load_csv, load_json
from pipetrain.schedules.lowering import lower
from pipetrain.schedules.registry import SCHEDULE_NAMES, build_schedule


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_round_trips_of_every_schedule(name: str, tmp_path: Path) -> None:
    schedule = build_schedule(name, 4, 8)
    dump_json(schedule, tmp_path / "s.json")
    assert load_json(tmp_path / "s.json") == schedule
    dump_csv(schedule, tmp_path / f"{name}.csv")
    loaded = load_csv(tmp_path / f"{name}.csv")
    assert loaded.actions == schedule.actions
    assert loaded.placement == schedule.placement  # linear, looped, v, bidirectional
    assert loaded.microbatches == schedule.microbatches
    assert loaded.asynchronous == schedule.asynchronous
    assert loaded.name == name


def test_lowered_schedule_round_trips(tmp_path: Path) -> None:
    schedule = lower(build_schedule("interleaved-1f1b", 2, 4))
    dump_csv(schedule, tmp_path / "s.csv")
    assert load_csv(tmp_path / "s.csv").actions == schedule.actions
    dump_json(schedule, tmp_path / "s.json")
    assert load_json(tmp_path / "s.json") == schedule


def test_csv_layout_is_pytorch_like(tmp_path: Path) -> None:
    dump_csv(build_schedule("gpipe", 2, 2), tmp_path / "g.csv")
    assert (tmp_path / "g.csv").read_text() == "0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n"


def test_hand_edited_csv_with_spaces_and_blank_cells(tmp_path: Path) -> None:
    path = tmp_path / "mine.csv"
    path.write_text(" 0F0, 0F1 ,  ,0B0,0B1,,\n1F0 ,1F1,1B0,   1B1\n\n\n")
    schedule = load_csv(path)
    assert schedule.actions == build_schedule("gpipe", 2, 2).actions
    assert schedule.placement.kind == "linear"
    assert schedule.name == "mine"


def test_custom_placement_is_inferred(tmp_path: Path) -> None:
    path = tmp_path / "c.csv"
    path.write_text("0F0,1F0,1B0,0B0\n2F0,2B0\n")
    schedule = load_csv(path)
    assert schedule.placement.kind == "custom"
    assert schedule.placement.stage_to_rank == (0, 0, 1)


def errors(path: Path, text: str, **kwargs: int) -> str:
    path.write_text(text)
    load = load_json if path.suffix == ".json" else load_csv
    with pytest.raises(ScheduleError) as info:
        load(path, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_csv_errors(tmp_path: Path) -> None:
    csv = tmp_path / "s.csv"
    assert "row 2, column 3: 'OB1' is not an action" in errors(csv, "0F0,0B0\n1F0,1B0,OB1\n")
    assert "has no actions" in errors(csv, "\n, ,\n")
    assert "2 rows but 4 ranks were asked for" in errors(csv, "0F0,0B0\n1F0,1B0\n", num_ranks=4)
    assert "stage 1 never appears" in errors(csv, "0F0,0B0\n2F0,2B0\n")
    assert "stage 1 never appears, but stage 99999999999 does" in errors(
        csv, "0F0,0B0\n99999999999F0,99999999999B0\n"
    )
    assert "micro-batch 1 never runs" in errors(csv, "0F0,0B0,0F99999999999\n1F0,1B0\n")
    # Loading validates: a stage on two ranks is reported with its position.
    message = errors(csv, "0F0,0B0,1F1\n1F0,1B0\n")
    assert "rank 0, position 2 (1F1)" in message and "two ranks" in message


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ScheduleError, match=r"cannot read schedule file .*: check the path"):
        load_csv(tmp_path / "missing.csv")
    with pytest.raises(ScheduleError, match="cannot read schedule file"):
        load_json(tmp_path)  # a directory


def test_json_errors(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    dump_json(build_schedule("1f1b", 2, 2), good)
    doc = json.loads(good.read_text())
    bad = tmp_path / "bad.json"

    def variant(**changes: object) -> str:
        return json.dumps({**doc, **changes})

    assert "not valid JSON" in errors(bad, "{")
    assert "format 2 is not supported" in errors(bad, variant(format=2))
    assert "'actions' has 1 rows for pp=2" in errors(bad, variant(actions=doc["actions"][:1]))
    assert "is for pp=2 but 3 ranks" in errors(bad, good.read_text(), num_ranks=3)
    assert "field 'pp' must be int" in errors(bad, variant(pp="2"))
    assert "actions row 1, item 0" in errors(bad, variant(actions=[doc["actions"][0], ["x"]]))
    placement = {**doc["placement"], "stage_to_rank": [0, 5]}
    assert "placement: stage 1 is placed on rank 5" in errors(bad, variant(placement=placement))
    missing = {k: v for k, v in doc.items() if k != "microbatches"}
    assert "missing field 'microbatches'" in errors(bad, json.dumps(missing))
    assert "deadlocks" in errors(
        bad, variant(actions=[["0F0", "0B0", "0F1", "0B1"], ["1F1", "1F0", "1B0", "1B1"]])
    )


def test_csv_hints_for_spreadsheet_separators_and_lower_case(tmp_path: Path) -> None:
    csv = tmp_path / "s.csv"
    for sep in (";", "\t", " "):
        message = errors(csv, f"0F0{sep}0B0\n1F0{sep}1B0\n")
        assert "row 1, column 1" in message and "holds several actions" in message
        assert "separate them with commas" in message
    assert "kinds are upper case, write '0F0'" in errors(csv, "0f0,0B0\n1F0,1B0\n")
    # Not several actions, not a case slip: the general message.
    assert "'0F0;x' is not an action: write STAGE KIND MICROBATCH" in errors(csv, "0F0;x\n")


def test_csv_microbatch_count_asked_for_must_match_the_file(tmp_path: Path) -> None:
    csv = tmp_path / "s.csv"
    text = "0F0,0B0,0F1,0B1\n1F0,1B0,1F1,1B1\n"
    for asked in (1, 3):
        message = errors(csv, text, microbatches=asked)
        assert f"numbers its micro-batches 0..1 (2), not the {asked} asked for" in message
        assert "use --microbatches 2" in message
    assert load_csv(csv, microbatches=2).microbatches == 2


def test_files_too_large_or_with_huge_numbers_are_one_line(tmp_path: Path) -> None:
    big = tmp_path / "data.csv"
    with big.open("wb") as file:  # sparse: a data set passed by mistake
        file.truncate(64 * 2**20 + 1)
    with pytest.raises(ScheduleError, match=r"is over 64 MiB.*check the path"):
        load_csv(big)
    # Python refuses ints of over 4300 digits with a ValueError that is not a JSON error.
    message = errors(tmp_path / "n.json", '{"format": 1, "pp": 1' + "0" * 5000 + "}")
    assert "a number of thousands of digits" in message


def test_bytes_that_are_not_utf8_are_counted_from_the_start_of_the_file(tmp_path: Path) -> None:
    path = tmp_path / "s.csv"
    path.write_bytes(b"\xef\xbb\xbf0F0,\xff\n")
    with pytest.raises(ScheduleError, match=r"not UTF-8 text \(byte 7 cannot be decoded\)"):
        load_csv(path)


def test_json_of_the_wrong_shape_names_the_field_and_the_fix(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    dump_json(build_schedule("1f1b", 2, 2), good)
    doc = json.loads(good.read_text())
    bad = tmp_path / "bad.json"

    def variant(**changes: object) -> str:
        return json.dumps({**doc, **changes})

    def placement(**changes: object) -> str:
        return variant(placement={**doc["placement"], **changes})

    # A misspelt optional field was ignored without a word.
    assert "unknown field 'param': use format, name" in errors(bad, variant(param={"v": 1}))
    assert "placement: unknown field 'stages'" in errors(bad, placement(stages=2))
    assert "field 'pp' must be 1 or more, got -1" in errors(bad, variant(pp=-1))
    assert "'stage_to_rank' must list one rank number" in errors(bad, placement(stage_to_rank=[]))
    assert "'num_model_stages' must be 1 or more, got 0" in errors(
        bad, placement(num_model_stages=0)
    )
    # num_model_stages was read inside the placement's try and its error wrapped twice.
    message = errors(bad, placement(num_model_stages=True))
    assert message.count("placement:") == 1 and "must be int, got True" in message
    message = errors(bad, placement(num_model_stages=3))
    assert "not whole replicas of 3 model stages: fix 'stage_to_rank'" in message
    rows = [["0F0", None, "0B0", "0B1"], doc["actions"][1]]
    assert "item 1: null is not an action text: write each action as a string" in errors(
        bad, variant(actions=rows)
    )
    message = errors(bad, variant(actions="0F0," * 100_000))
    assert "field 'actions' must be list, got '0F0,0F0," in message and len(message) < 200


def test_pytorch_only_actions_say_what_to_do(tmp_path: Path) -> None:
    # PyTorch pipelining's CSV (the layout we share) may hold FSDP and overlap actions.
    csv = tmp_path / "torch.csv"
    message = errors(csv, "0UNSHARD,0F0,0B0\n1F0,1B0\n")
    assert "'0UNSHARD' is PyTorch pipelining's UNSHARD" in message and "remove it" in message
    assert "REDUCE_GRAD" in errors(csv, "0F0,0B0,0REDUCE_GRAD\n1F0,1B0\n")
    message = errors(csv, "0F0,0F1,0B0,0B1\n1F0,(1F1;1B0)OVERLAP_F_B,1B1\n")
    assert "row 2, column 2" in message and "write them as two cells" in message


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
