"""experiments/imagenet/sweep.py: the grid, resuming from logs, the report, a tiny sweep."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "experiments" / "imagenet"
sys.path.insert(0, str(HERE))  # sweep.py imports its siblings as the scripts do

import sweep  # noqa: E402
import sweep_report  # noqa: E402
from sweep import Setting  # noqa: E402

TIMEOUT = 300  # seconds for the end-to-end sweep: a hang fails the test instead of the suite


# ---- the grid -----------------------------------------------------------------------------------
def test_parse_list_keeps_order_and_drops_duplicates():
    assert sweep.parse_list("0.1, 0.01,0.1,", "density") == [0.1, 0.01]
    assert sweep.parse_list("4096,256", "chunk") == [4096, 256]
    assert sweep.parse_list("2,0,1", "seed") == [2, 0, 1]
    assert sweep.parse_list("1,56", "link") == [1.0, 56.0]


@pytest.mark.parametrize("text, kind, words", [
    ("", "density", "empty density list"),
    ("0.1,abc", "density", "'abc'"),
    ("0", "density", "(0, 1]"),
    ("1.5", "density", "(0, 1]"),
    ("1024,0", "chunk", "positive"),
    ("1.5", "chunk", "not a number"),
    ("-1", "seed", ">= 0"),
    ("0", "link", "positive"),
])
def test_parse_list_refuses_bad_values_with_a_sentence(text, kind, words):
    with pytest.raises(ValueError, match=None) as info:
        sweep.parse_list(text, kind)
    assert words in str(info.value), info.value


def test_cross_grid_cuts_through_the_reference_point():
    grid = sweep.build_grid([0.1, 0.03, 0.01, 0.003, 0.001], [256, 1024, 4096])
    assert grid[:2] == [Setting("dense"), Setting("fp16")]
    csc = grid[2:]
    assert len(csc) == 7 and len(set(csc)) == 7
    assert sorted(s.density for s in csc if s.chunk_size == 1024) == [0.001, 0.003, 0.01, 0.03, 0.1]
    assert sorted(s.chunk_size for s in csc if s.density == 0.01) == [256, 1024, 4096]


def test_full_grid_and_a_reference_outside_the_lists():
    assert len(sweep.build_grid([0.1, 0.01], [256, 1024, 4096], full=True, baselines=False)) == 6
    # Neither 0.01 nor 1024 given: the first of each list is the reference.
    grid = sweep.build_grid([0.5, 0.2], [64, 128], baselines=False)
    assert grid == [Setting("csc", 0.5, 64), Setting("csc", 0.2, 64), Setting("csc", 0.5, 128)]


def test_setting_keys_are_distinct_file_names_and_flags_name_the_setting():
    s = Setting("csc", 0.003, 256)
    assert s.key == "csc-d0.003-c256" and "/" not in s.key
    assert s.train_args() == ["--compression", "csc", "--density", "0.003", "--chunk-size", "256"]
    assert Setting("dense").train_args() == ["--compression", "none"]


# ---- resuming from the logs ---------------------------------------------------------------------
class FakeLauncher:
    """Stands in for torchrun: writes the log a finished run writes, or fails on request."""

    def __init__(self, epochs: int, fail: set = frozenset()):
        self.epochs, self.fail, self.calls = epochs, set(fail), []

    def __call__(self, train_args, log, console, nproc, timeout):
        seed = int(train_args[train_args.index("--seed") + 1])
        self.calls.append((log.name, seed))
        console.write_text("fake\n")
        if log.name in self.fail:
            log.write_text(json.dumps(_record(0)) + "\n")  # died after its first epoch
            raise RuntimeError("exit 1: fake failure")
        log.write_text("".join(json.dumps(_record(e, seed=seed)) + "\n"
                               for e in range(self.epochs)))


def _record(epoch: int, seed: int = 0, top1: float = 90.0, wire: float = 1000.0,
            step_s: float = 0.1) -> dict:
    return {"epoch": epoch, "steps": 10, "train_time_s": 10 * step_s, "images_per_s": 64 / step_s,
            "val_top1": top1 + seed, "wire_bytes": 10 * wire, "dense_bytes": 10 * 4000.0,
            "wire_bytes_per_step": wire, "dense_bytes_per_step": 4000.0}


def _run(tmp_path, launcher, grid, seeds=(0, 1), common=("data", "-a", "resnet18")):
    return sweep.run_grid(grid, list(seeds), list(common), launcher.epochs, tmp_path,
                          progress=False, launcher=launcher, csc_args=["--momentum-correction"])


def test_an_interrupted_sweep_reruns_only_what_is_unfinished(tmp_path):
    grid = sweep.build_grid([0.1, 0.01], [1024])
    first = FakeLauncher(epochs=2, fail={"csc-d0.01-c1024-seed1.jsonl"})
    failures = _run(tmp_path, first, grid)
    assert len(first.calls) == 8 and list(failures) == [("csc-d0.01-c1024", 1)]
    # Seed-major: every setting at seed 0 before any at seed 1.
    assert [seed for _, seed in first.calls] == [0] * 4 + [1] * 4

    again = FakeLauncher(epochs=2)
    assert _run(tmp_path, again, grid) == {}
    assert again.calls == [("csc-d0.01-c1024-seed1.jsonl", 1)]

    # A log torn mid-epoch (a killed sweep) is not finished either.
    log, _, _ = sweep.log_paths(tmp_path, Setting("fp16"), 0)
    log.write_text(log.read_text() + '{"epoch": 2, "ste')
    torn = FakeLauncher(epochs=2)
    assert sweep.read_log(log)[-1]["epoch"] == 1
    _run(tmp_path, torn, grid)
    assert torn.calls == []  # two complete epochs and a torn line: complete for epochs=2
    longer = FakeLauncher(epochs=3)
    _run(tmp_path, longer, grid)
    assert len(longer.calls) == 8  # another epoch count is another run


def test_runs_at_a_time_run_each_job_once_and_resume_the_same(tmp_path):
    grid = sweep.build_grid([0.1, 0.01], [1024])
    launcher = FakeLauncher(epochs=1, fail={"fp16-seed1.jsonl"})
    failures = sweep.run_grid(grid, [0, 1], ["data"], 1, tmp_path, jobs=3, progress=False,
                              launcher=launcher)
    assert sorted(launcher.calls) == sorted(
        (f"{s.key}-seed{seed}.jsonl", seed) for seed in (0, 1) for s in grid)
    assert list(failures) == [("fp16", 1)]
    again = FakeLauncher(epochs=1)
    sweep.run_grid(grid, [0, 1], ["data"], 1, tmp_path, jobs=3, progress=False, launcher=again)
    assert again.calls == [("fp16-seed1.jsonl", 1)]


def test_a_run_with_other_arguments_is_not_reused(tmp_path):
    grid = [Setting("dense")]
    _run(tmp_path, FakeLauncher(epochs=1), grid, seeds=(0,))
    other = FakeLauncher(epochs=1)
    _run(tmp_path, other, grid, seeds=(0,), common=("data", "-a", "resnet50"))
    assert other.calls == [("dense-seed0.jsonl", 0)]
    _, meta, _ = sweep.log_paths(tmp_path, Setting("dense"), 0)
    assert "resnet50" in json.loads(meta.read_text())["train_args"]


def test_logs_of_the_builtin_data_are_reused_from_another_checkout(tmp_path):
    grid = [Setting("dense")]
    here = "/one/clone/experiments/imagenet/data/digits"
    there = "/another/clone/experiments/imagenet/data/digits"
    _run(tmp_path, FakeLauncher(epochs=1), grid, seeds=(0,), common=(here, "-a", "resnet18"))
    moved = FakeLauncher(epochs=1)
    _run(tmp_path, moved, grid, seeds=(0,), common=(there, "-a", "resnet18"))
    assert moved.calls == []
    other_data = FakeLauncher(epochs=1)
    _run(tmp_path, other_data, grid, seeds=(0,), common=("/data/imagenet", "-a", "resnet18"))
    assert other_data.calls == [("dense-seed0.jsonl", 0)]


# ---- the report ---------------------------------------------------------------------------------
def _row(key, method, top1, wire, step_s=0.1, codec_s=0.0, sd=0.0):
    return {"key": key, "label": key, "method": method, "top1_mean": top1, "top1_sd": sd,
            "wire_bytes_per_step": wire, "fastest_step_s": step_s, "codec_s": codec_s,
            "eval_set": "validation"}


def test_step_time_model_is_compute_plus_codec_plus_ring_bytes_over_the_link():
    row = _row("dense", "dense", 97.0, 1.25e8, step_s=0.2)
    # 2 ranks: each link carries the whole buffer once; 1e9 bit/s moves 1.25e8 bytes in 1 s.
    assert sweep_report.predict_step_s(row, 1.0, 2) == pytest.approx(1.2)
    assert sweep_report.predict_step_s(row, 1.0, 4) == pytest.approx(0.2 + 1.5)
    csc = _row("csc", "csc", 97.0, 0.0, step_s=0.5, codec_s=0.05)
    # Two rounds (norms, chunks) of 2(n-1) ring steps, 10 us each; compute shared, codec its own.
    assert sweep_report.predict_step_s(csc, 1.0, 2, latency_us=10, compute_s=0.2) == \
        pytest.approx(0.2 + 0.05 + 4e-5)
    # The shared compute is the dense runs' fastest step, however slow the others ran.
    assert sweep_report.compute_time([row, csc]) == pytest.approx(0.2)


def test_recommendation_takes_the_most_accurate_within_the_margin():
    rows = [_row("dense", "dense", 98.0, 4.4e7, step_s=0.30),
            _row("csc-1%", "csc", 97.5, 3e5, step_s=0.9, codec_s=0.02),
            _row("csc-0.1%", "csc", 95.0, 9e4, step_s=0.9, codec_s=0.01)]
    slow = sweep_report.recommend(rows, 1.0, 10.0, 2)
    assert slow["fastest"]["key"] == "csc-0.1%" and slow["choice"]["key"] == "csc-1%"
    fast = sweep_report.recommend(rows, 56.0, 10.0, 2)
    assert fast["choice"]["key"] == "dense"  # 6 ms of wire: every setting is within 10%
    strict = sweep_report.recommend(rows, 1.0, 0.0, 2)
    assert strict["choice"]["key"] == "csc-0.1%"


def test_no_recommendation_ranks_a_setting_scored_on_the_test_set(tmp_path):
    rows = [_row("dense", "dense", 98.0, 4.4e7, step_s=0.30),
            dict(_row("csc-1%", "csc", 97.5, 3e5, step_s=0.9, codec_s=0.02), eval_set="test")]
    rec = sweep_report.recommend(rows, 1.0, 10.0, 2)
    assert rec["choice"] is None and "csc-1% scored on the test set" in rec["why"]
    assert "no recommendation" in sweep_report.recommendation_line(rec, 10.0)
    # the built-in digits hold a validation split out by default; other data only when asked
    args = sweep.parse_args([])
    assert sweep.common_train_args(args)[-4:-2] == ["--val-split", "360"]
    (tmp_path / "train" / "a").mkdir(parents=True)
    assert "--val-split" not in sweep.common_train_args(sweep.parse_args([str(tmp_path)]))
    assert "--val-split" in sweep.common_train_args(sweep.parse_args([str(tmp_path),
                                                                      "--val-split", "9"]))


def test_pareto_front_drops_dominated_settings():
    rows = [_row("a", "csc", 90.0, 1e4), _row("b", "csc", 89.0, 2e4), _row("c", "csc", 95.0, 3e4),
            _row("d", "dense", 97.0, 4e7)]
    assert [r["key"] for r in sweep_report.pareto_front(rows)] == ["a", "c", "d"]


# ---- a tiny sweep, end to end -------------------------------------------------------------------
def test_tiny_sweep_end_to_end_writes_table_plot_and_resumes(tmp_path):
    import prepare

    data = prepare.prepare(tmp_path / "digits", size=16, limit=200)  # every class in both splits
    out = tmp_path / "sweep"
    cmd = [sys.executable, str(HERE / "run_experiment.py"), str(data), "--densities", "0.1",
           "--chunk-sizes", "256", "--seeds", "0", "--epochs", "1", "--nproc", "1",
           "--train-args", "-b 8 --image-size 16 --augment none --steps-per-epoch 2 -j 0 "
           "--warmup none",
           "--link-gbps", "1,56", "--timeout", "200", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    table = (out / "sweep.md").read_text()
    for label in ("dense FP32", "FP16", "CSC 10% c256"):
        assert f"| {label} |" in table, table
    assert "- 1 Gbit/s:" in table and "- 56 Gbit/s:" in table
    assert (out / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = {r["key"]: r for r in json.loads((out / "sweep.json").read_text())["rows"]}
    assert rows["csc-d0.1-c256"]["wire_bytes_per_step"] < rows["fp16"]["wire_bytes_per_step"] \
        < rows["dense"]["wire_bytes_per_step"]

    logs = sorted((out / "logs").glob("*.jsonl"))
    stamps = [p.stat().st_mtime_ns for p in logs]
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [p.stat().st_mtime_ns for p in logs] == stamps  # nothing was run again
    assert "3/3" in again.stdout
