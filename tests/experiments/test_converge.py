"""experiments/imagenet/converge.py and converge_report.py: the convergence stage's run order,
resumption and protocol, and the report's interval arithmetic on synthetic logs."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[2] / "experiments" / "imagenet"
sys.path.insert(0, str(HERE))
import converge  # noqa: E402
import converge_report  # noqa: E402


def test_the_interval_is_students_t_on_the_paired_differences():
    # Hand computation: d = 0.5, -0.1, 0.3, 0.2, -0.4; mean 0.1; squared deviations
    # 0.16 + 0.04 + 0.04 + 0.01 + 0.25 = 0.5, variance 0.5 / 4 = 0.125, sd 0.353553;
    # standard error 0.353553 / sqrt(5) = 0.158114; t(0.975, 4) = 2.776445 (tables);
    # half-width 0.438995: [-0.338995, 0.538995].
    base = {10: 90.0, 11: 91.0, 12: 89.5, 13: 90.5, 14: 90.2}
    ours = {10: 90.5, 11: 90.9, 12: 89.8, 13: 90.7, 14: 89.8, 15: 99.0}  # 15: no DDP pair
    iv = converge_report.paired_interval(ours, base)
    assert iv["seeds"] == [10, 11, 12, 13, 14] and iv["dof"] == 4
    assert iv["mean"] == pytest.approx(0.1)
    assert iv["sd"] == pytest.approx(math.sqrt(0.125))
    assert converge_report.t_quantile(0.975, 4) == pytest.approx(2.776445, abs=1e-6)
    assert iv["low"] == pytest.approx(-0.338995, abs=1e-5)
    assert iv["high"] == pytest.approx(0.538995, abs=1e-5)
    assert converge_report.paired_interval({10: 1.0}, {10: 0.0}) is None  # one pair: no sd


def _write_run(folder: Path, key: str, seed: int, test: float, epochs: int = 2,
               args: list | None = None, step_s: float = 0.1) -> None:
    logs = folder / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    records = [{"epoch": e, "val_top1": 80.0 + e, "eval_set": "validation", "steps": 100,
                "train_time_s": 100 * step_s,
                "rank_cpu_s": [60.0 * (e + 1), 66.0 * (e + 1)]} for e in range(epochs)]
    records[-1].update(test_top1=test, test_top5=99.0, test_loss=0.3)
    (logs / f"{key}-seed{seed}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    meta = {"setting": key, "seed": seed, "link_gbps": None, "wall_s": 120.0, "args": args or [],
            "loadavg_before": [1.0, 1.0, 1.0], "commit": "abc123"}
    (logs / f"{key}-seed{seed}.meta.json").write_text(json.dumps(meta) + "\n")


def test_the_report_gives_means_paired_intervals_costs_and_the_goal(tmp_path):
    ddp = [90.0, 91.0, 89.5, 90.5, 90.2]
    ours = [90.5, 90.9, 89.8, 90.7, 89.8]
    for seed, d, o in zip(range(10, 15), ddp, ours):
        _write_run(tmp_path / "resnet_shaped", "ddp-gloo", seed, d)
        _write_run(tmp_path / "resnet_shaped", "csc-default", seed, o)
    text = converge_report.write(tmp_path, "fashion-mnist", ["resnet_shaped"],
                                 ["ddp-gloo", "csc-default", "powersgd-4"], list(range(10, 15)),
                                 2, "cmd")
    row = next(line for line in text.splitlines() if line.startswith("| GradientFlow CSC"))
    assert "| 90.34 ± 0.51 |" in row and "| +0.10 (n=5) | [-0.34, +0.54] |" in row
    assert "| 81.00 ± 0.00 |" in row  # the last epoch's validation top-1
    assert "| 2.0 | 4.2 |" in row  # 120 s of wall; 120 + 132 CPU seconds, both ranks
    assert "| 100.0 | +0.0 [+0.0, +0.0] | 0.0 |" in row  # ms per step, paired; no bytes logged
    assert "**met**" in text and "does not rule out a loss of more than 0.3" in text
    assert "DDP + PowerSGD rank 4" not in text  # a setting without runs has no row
    assert "In progress: 10 of 15 runs finished" in text  # PowerSGD's five are still to run
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resnet_shaped"]["csc-default"]["vs_ddp"]["dof"] == 4


def test_a_finished_stage_says_nothing_of_progress(tmp_path):
    for seed in (10, 11):
        _write_run(tmp_path / "m", "ddp-gloo", seed, 90.0)
    text = converge_report.write(tmp_path, "fashion-mnist", ["m"], ["ddp-gloo"], [10, 11], 2,
                                 "cmd")
    assert "In progress" not in text
    text = converge_report.write(tmp_path, "fashion-mnist", ["m"], ["ddp-gloo"], [10, 11, 12],
                                 2, "cmd")
    assert "In progress: 2 of 3 runs finished" in text


def test_a_run_without_its_test_evaluation_is_not_reported(tmp_path):
    _write_run(tmp_path / "m", "ddp-gloo", 10, 90.0)
    path = tmp_path / "m" / "logs" / "ddp-gloo-seed10.jsonl"
    records = [json.loads(x) for x in path.read_text().splitlines()]
    del records[-1]["test_top1"]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert converge_report.load(tmp_path / "m", "ddp-gloo", [10], 2) == {}


def test_runs_go_seed_by_seed_and_a_finished_run_is_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(converge.rx, "data_args", lambda data, model, recipe: [f"<{model}>"])
    started = []

    def runner(key, seed, epochs, folder, nproc, backend, timeout, link, lock, common):
        started.append((folder.name, key, seed))
        args = [*common, *converge.rx.SETTINGS[key][1], "--epochs", str(epochs), "--seed",
                str(seed), "--dist-backend", backend]
        _write_run(folder, key, seed, 90.0, epochs, args)

    models, keys = ["a", "b"], ["ddp-gloo", "csc-default"]
    fails = converge.run_stage(tmp_path, "fashion-mnist", models, keys, [10, 11], 2, 1, 60, [],
                               runner=runner)
    assert not fails
    assert started == [(m, k, s) for s in (10, 11) for m in models for k in keys]
    assert "--report-test" in converge.train_args("fashion-mnist", "a", [])
    started.clear()
    converge.run_stage(tmp_path, "fashion-mnist", models, keys, [10, 11], 2, 1, 60, [],
                       runner=runner)
    assert started == []  # every log complete, with its test evaluation and the same arguments
    converge.run_stage(tmp_path, "fashion-mnist", models, keys, [10, 11], 2, 1, 60,
                       ["--lr", "0.1"], runner=runner)
    assert len(started) == 8  # other arguments: run again


def test_the_stage_refuses_screening_seeds(capsys):
    with pytest.raises(SystemExit) as exc:
        converge.main(["--seeds", "0", "1", "--timeout", "1"])
    assert exc.value.code == 2 and "seeds 0-9" in capsys.readouterr().err


def test_a_stage_pairs_with_the_baseline_it_names_and_reports_its_step_time(tmp_path):
    torch_ms, ours_ms = [130.0, 128.0, 131.0], [120.0, 119.0, 123.0]
    for seed, t, o in zip((10, 11, 12), torch_ms, ours_ms):
        _write_run(tmp_path / "m", "powersgd-4", seed, 90.0, step_s=t / 1000)
        _write_run(tmp_path / "m", "gf-powersgd-4", seed, 90.5, step_s=o / 1000)
        _write_run(tmp_path / "m", "ddp-gloo", seed, 95.0)
    text = converge_report.write(tmp_path, "fashion-mnist", ["m"],
                                 ["powersgd-4", "gf-powersgd-4", "ddp-gloo"], [10, 11, 12], 2,
                                 "cmd", baseline="powersgd-4", title="PowerSGD")
    assert text.startswith("# PowerSGD") and "Δ vs DDP + PowerSGD rank 4, paired" in text
    row = next(line for line in text.splitlines() if line.startswith("| GradientFlow PowerSGD"))
    assert "| +0.50 (n=3) |" in row and "| 120.7 | -9.0 [" in row
    base = next(line for line in text.splitlines() if line.startswith("| DDP + PowerSGD"))
    assert "| - | - |" in base  # the baseline is not paired with itself
    assert "Goal, the CSC default" not in text
