"""benchmarks/autotune_matrix.py: rows recomputed by bench_autotune's `_row`, their order, the
load and time from each launch's log, and the cells of the matrix that have no folder."""
from __future__ import annotations

import json

import pytest

from benchmarks import autotune_matrix
from benchmarks.bench_autotune import _row

MB = 10**6
DEFAULTS = {"fusion_threshold": 134217728, "solo_threshold": 4 * MB, "cycle_time_ms": 3.0,
            "fusion_segments": 2}
GRID = ("fuse 8MB solo 4MB cycle 3ms seg 2", "fuse 128MB solo 1MB cycle 1ms seg 2")


def cell(scale: float, chosen: dict | None = None, slower: float = 1.0) -> dict:
    """One model's raw entry, shaped like bench_autotune's (fewer reps and grid points)."""
    chosen = chosen or {**DEFAULTS, "fusion_threshold": 8 * MB, "fusion_segments": 3}
    reps = {"defaults": [100.0, 104.0, 98.0], "autotune": [90.0, 95.0, 88.0],
            GRID[0]: [92.0, 97.0, 91.0], GRID[1]: [120.0, 118.0, 125.0]}
    reps = {k: [x * scale * (slower if k == "autotune" else 1) for x in v]
            for k, v in reps.items()}
    return {"tensors": 16, "bytes": 244403360, "tune_steps": 91, "tune_s": 20.0,
            "chosen": chosen,
            "summary": {"gain": 0.08, "importance": {"solo_threshold": 0.2,
                                                     "fusion_threshold": 0.7}},
            "variants": {"defaults": DEFAULTS, "autotune": chosen},
            "reps_ms": reps, "ms": {k: sorted(v)[1] for k, v in reps.items()},
            "best_grid": GRID[0],
            "h2h_ms": {k: [x * 1.01 for x in reps[k]] for k in ("autotune", GRID[0],
                                                               "defaults")}}


def launch(root, folder: str, key: str, cells: dict, log: str | None) -> None:
    d = root / folder
    d.mkdir()
    (d / "autotune.json").write_text(json.dumps({"name": "autotune", "rows": [],
                                                 "raw": {key: cells}}))
    if log is not None:
        (d / "log.txt").write_text(log)


LOG = ("start: 00:34:12  00:34:12 up  3:52,  0 user,  load average: 20.36, 17.92, 15.52\n"
       "... the benchmark's output ...\n"
       "end: 00:37:31  00:37:31 up  3:55,  0 user,  load average: 18.58, 18.03, 16.01\n")


def test_rows_order_load_and_missing_cells(tmp_path, capsys):
    # Neither the launch's order nor the alphabet is the table's.
    # alexnet kept the defaults; bert-base's choice is 17% slower than the grid's best.
    loop = {"alexnet": cell(2.0, DEFAULTS), "resnet50": cell(1.0),
            "bert-base": cell(3.0, slower=1.2)}
    net = {"bert-base": cell(5.0)}
    launch(tmp_path, "tnone_w2_alexnet+resnet50+bert-base", "loopback 2", loop, LOG)
    launch(tmp_path, "t10_w4_bert-base", "10 Gbps 4", net,
           LOG.replace("20.36", "11.77").split("end:")[0])  # a launch that never ended
    (tmp_path / "notes").mkdir()  # not a launch: skipped
    assert autotune_matrix.main(["--root", str(tmp_path)]) == 0

    rows = json.loads((tmp_path / "matrix.json").read_text())["rows"]
    # The 10 Gbit/s tier first, then ranks, then bert-base, resnet50, alexnet.
    assert [(r["tier"], r["ranks"], r["model"]) for r in rows] == [
        ("10 Gbps", 4, "bert-base"), ("loopback", 2, "bert-base"), ("loopback", 2, "resnet50"),
        ("loopback", 2, "alexnet")]
    # Each row is _row's, to the digit, with the launch's load and time beside it.
    expected = [_row("10 Gbps", 4, "bert-base", net["bert-base"]),
                _row("loopback", 2, "bert-base", loop["bert-base"]),
                _row("loopback", 2, "resnet50", loop["resnet50"]),
                _row("loopback", 2, "alexnet", loop["alexnet"])]
    assert [{k: r[k] for k in e} for r, e in zip(rows, expected)] == expected
    assert rows[3]["kept defaults"] == "yes" and rows[2]["kept defaults"] == "no"
    assert [(r["load 1-min start/end"], r["UTC"]) for r in rows] == [
        ("11.77/-", "00:34:12--")] + [("20.36/18.58", "00:34:12-00:37:31")] * 3

    md = (tmp_path / "matrix.md").read_text().splitlines()
    table = [line for line in md if line.startswith("| ")]
    assert table[0].split(" | ")[-2:] == ["load 1-min start/end", "UTC |"]
    assert "grid-phase best ms" not in table[0] and "mattered most" not in table[0]
    assert table[3].startswith(f"| loopback | 2 | resnet50 | 91 | "
                               f"{expected[2]['default ms']:.1f} | ")
    assert table[3].endswith("| 20.36/18.58 | 00:34:12-00:37:31 |")
    assert "autotune_matrix.py" in "\n".join(md[:20])

    assert [e["within 5%"] for e in expected] == ["yes", "no", "yes", "yes"]
    out = capsys.readouterr().out.strip()
    assert out.startswith("3 of 4 cells within 5%")
    gone = out.split("no folder: ")[1]
    assert gone.count("(") == 8 and "(10 Gbps, 4, bert-base)" not in gone
    assert "(loopback, 4, bert-base)" in gone and "(10 Gbps, 2, resnet50)" in gone
    assert "(loopback, 2, resnet50)" not in gone and "(loopback, 2, bert-base)" not in gone


def test_folder_that_does_not_hold_its_launch(tmp_path):
    launch(tmp_path, "t10_w2_alexnet", "loopback 2", {"alexnet": cell(1.0)}, LOG)
    with pytest.raises(ValueError, match="t10_w2_alexnet.*'loopback 2'"):
        autotune_matrix.gather(str(tmp_path))
