"""bench_autotune --quick runs end to end and reports what the issue asks for (no speed is
checked: the machine is shared)."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.skipif(importlib.util.find_spec("optuna") is None, reason="optuna is not installed")
def test_quick_benchmark_reports_grid_choice_and_gain(tmp_path):
    from benchmarks import bench_autotune

    assert bench_autotune.main(["--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "autotune.json").read_text())
    (row,) = data["rows"]
    tuner = data["tuner"]
    race = tuner["confirm"] * (tuner["finalists"] + 1)
    most = (tuner["trials"] + race) * (tuner["warmup"] + tuner["steps"]) + 1
    assert row["model"] == "tiny" and 0 < row["tune steps"] <= most
    assert row["within 5%"] in ("yes", "no") and row["best grid"].startswith("fuse ")
    raw = data["raw"]["loopback 2"]["tiny"]
    assert len(raw["reps_ms"]) == len(data["grid"]) + 2
    assert all(len(v) == 3 and min(v) > 0 for v in raw["reps_ms"].values())
    assert (tmp_path / "autotune.md").read_text().startswith("## Autotune")
