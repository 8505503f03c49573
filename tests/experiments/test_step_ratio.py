"""experiments/imagenet/step_ratio.py: paired per-seed step-time ratios on synthetic logs."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[2] / "experiments" / "imagenet"
sys.path.insert(0, str(HERE))
import step_ratio  # noqa: E402


def _write(folder: Path, key: str, seed: int, ms: list, forward: float,
           cpu_ms: float | None = None) -> None:
    """A run's log: one epoch per entry of `ms` (ms a step over 10 steps); `cpu_ms`: each
    rank's CPU a step (ranks 0 and 1 at cpu_ms -/+ 1), cumulative as train.py logs it."""
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    rows = [{"epoch": e, "steps": 10, "train_time_s": m * 10 / 1e3,
             "phase_s": {"forward": forward * 10 / 1e3, "backward": 0.01}}
            for e, m in enumerate(ms)]
    if cpu_ms is not None:
        for e, r in enumerate(rows):
            r["rank_cpu_s"] = [5.0 + (e + 1) * (cpu_ms + d) * 10 / 1e3 for d in (-1, 1)]
    (folder / "logs" / f"{key}-seed{seed}.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows))


def test_ratios_are_paired_by_seed_on_the_last_epoch(tmp_path):
    # Per seed (last epoch): a/b = 1.1, 1.2, 1.0; the first epoch (warm-up) is ignored, and
    # seed 3 has no partner. Geometric mean exp(mean(log)) of the three.
    a, b = tmp_path / "a", tmp_path / "b"
    for seed, (ma, mb) in enumerate([(55.0, 50.0), (60.0, 50.0), (40.0, 40.0)]):
        _write(a, "x", seed, [500.0, ma], forward=5.0 + seed, cpu_ms=60.0 + seed)
        _write(b, "y", seed, [1.0, mb], forward=5.0, cpu_ms=58.0)
    _write(a, "x", 3, [1.0, 99.0], forward=1.0)
    out = tmp_path / "r.md"
    assert step_ratio.main([f"A={a}:x", f"B={b}:y", "--pairs", "A/B", "--out", str(out)]) == 0
    r = step_ratio.compare(step_ratio.runs_of(a, "x"), step_ratio.runs_of(b, "y"))
    assert r["seeds"] == [0, 1, 2]
    assert r["median"] == pytest.approx(1.1)
    logs = [math.log(1.1), math.log(1.2), 0.0]
    assert r["geomean"] == pytest.approx(math.exp(sum(logs) / 3))
    assert r["low"] < r["geomean"] < r["high"]
    assert r["phases"]["forward"] == pytest.approx(1.0)  # differences 0, 1, 2 ms: median 1
    assert r["cpu_delta"] == pytest.approx(3.0)  # CPU differences 2, 3, 4 ms: median 3
    text = out.read_text()
    assert "| A/B | 3 |" in text and "1.100" in text and "+1.00" in text and "+3.00" in text


def test_cpu_is_left_out_where_a_log_lacks_it(tmp_path):
    for seed in (0, 1):
        _write(tmp_path / "a", "x", seed, [9.0, 10.0], forward=1.0, cpu_ms=20.0)
        _write(tmp_path / "b", "y", seed, [9.0, 10.0], forward=1.0)  # an older log: no CPU
    r = step_ratio.compare(step_ratio.runs_of(tmp_path / "a", "x"),
                           step_ratio.runs_of(tmp_path / "b", "y"))
    assert r["cpu_delta"] is None
    assert "| - |" in step_ratio.table([("A/B", r)])


def test_a_pair_without_common_seeds_is_refused(tmp_path):
    _write(tmp_path / "a", "x", 0, [10.0], forward=1.0)
    _write(tmp_path / "b", "y", 1, [10.0], forward=1.0)
    with pytest.raises(SystemExit):
        step_ratio.main([f"A={tmp_path / 'a'}:x", f"B={tmp_path / 'b'}:y", "--pairs", "A/B"])


def test_cpu_by_thread_is_paired_by_seed(tmp_path):
    # The engine's thread 2, 3, 4 ms a step more than nothing; the caller's 1 ms less at each
    # seed; gloo's only on one side.
    for seed in range(3):
        for folder, key, cpu in ((tmp_path / "a", "x", {"MainThread": 9.0, "N-engine": 2.0 + seed,
                                                         "gloo_tcp_loop": 1.0}),
                                 (tmp_path / "b", "y", {"MainThread": 10.0})):
            _write(folder, key, seed, [9.0, 10.0], forward=1.0)
            log = folder / "logs" / f"{key}-seed{seed}.jsonl"
            rows = [json.loads(x) for x in log.read_text().splitlines()]
            for e, r in enumerate(rows):  # cumulative seconds over 10 steps an epoch
                r["thread_cpu_s"] = {k: (e + 1) * v * 10 / 1e3 for k, v in cpu.items()}
            log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = step_ratio.compare(step_ratio.runs_of(tmp_path / "a", "x"),
                           step_ratio.runs_of(tmp_path / "b", "y"))
    assert r["threads"]["N-engine"] == pytest.approx((3.0, 0.0, 3.0))
    assert r["threads"]["MainThread"] == pytest.approx((9.0, 10.0, -1.0))
    assert r["threads"]["gloo_tcp_loop"] == pytest.approx((1.0, 0.0, 1.0))
    r["threads"]["tqdm_monitor"] = (0.0, 0.0, 0.0)  # idle on both sides: left out
    text = step_ratio.thread_table([("A/B", r)])
    assert "| A/B | N-engine | 3.00 | 0.00 | +3.00 |" in text and "tqdm" not in text
