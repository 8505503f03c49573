"""Plumbing of the benchmark harness on tiny sizes: stats, launcher, netem lifecycle, runner.

Benchmarks are not tests: nothing here checks a speed, only that the pieces run, fail loudly
and clean up. Every multi-process step is bounded by a timeout; the whole file takes < 60 s.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from benchmarks.common import markdown_table, median, p95, paired_ratio, percentile
from benchmarks.launch import launch
from benchmarks.netem import PREFIX, Cluster, ShapeConfig, clean_stale, list_namespaces


def test_stats_and_table():
    assert median([3, 1, 2]) == 2
    assert median([1, 2, 3, 4]) == 2.5
    assert p95(range(101)) == pytest.approx(95)
    assert percentile([], 50) != percentile([], 50)  # NaN for no values
    md = markdown_table(["a", "b"], [{"a": 1.23456, "b": None}, {"a": "x|y"}])
    assert md.splitlines()[0] == "| a | b |"
    assert "1.23" in md and "| - |" in md and "x\\|y" in md


def test_paired_ratio_cancels_drift_and_bounds_the_median():
    # A machine that slows down 2x across the reps: a ratio of medians would still read 1.1,
    # and so must each pair, with an interval that holds it.
    slow = [100.0 * (1 + i / 20) for i in range(21)]
    fast = [x / 1.1 for x in slow]
    assert paired_ratio([slow], [fast]) == pytest.approx((1.1, 1.1, 1.1))
    noisy = [1.0 + (0.05 if i % 2 else -0.05) for i in range(40)]
    mid, lo, hi = paired_ratio([noisy], [[1.0] * 40])
    assert lo <= mid <= hi and lo < 1.0 < hi  # no difference resolved
    assert paired_ratio([noisy], [[1.0] * 40]) == (mid, lo, hi)  # seeded: reproducible
    # Launches that disagree (1.2x in one, 0.9x in two): tight within each launch, so only
    # resampling the launches shows that the data cannot settle the sign.
    launches = [[1.2] * 10, [0.9] * 10, [0.9] * 10]
    mid, lo, hi = paired_ratio(launches, [[1.0] * 10] * 3)
    assert mid == pytest.approx(0.9) and lo == pytest.approx(0.9) and hi == pytest.approx(1.2)
    with pytest.raises(ValueError, match="equally long"):
        paired_ratio([[1.0, 2.0]], [[1.0]])


def test_tbf_args_and_validation():
    args = ShapeConfig(rate_gbps=2.5).tbf_args()
    assert args[:3] == ["tbf", "rate", "2500000000bit"] and "burst" in args
    with pytest.raises(ValueError, match="rate_gbps"):
        ShapeConfig(rate_gbps=0)


def test_launch_collects_results_on_loopback():
    res = launch("benchmarks.launch:selftest_worker", 2, timeout_s=60)
    assert res.ok, res.error
    assert [r["sum"] for r in res.results] == [1.0, 1.0]


def test_fused_floor_sums_like_an_allreduce():
    from gradientflow.backend.backend import IS_PROCESS_GROUP

    if IS_PROCESS_GROUP:
        pytest.skip("this torch cannot subclass its Backend in Python (the floor needs 2.14)")
    res = launch("benchmarks.fused_floor:selftest_worker", 2, timeout_s=60)
    assert res.ok, res.error
    assert [r["ok"] for r in res.results] == [True, True]


def test_thread_cpu_counts_this_threads_work():
    from benchmarks.list_cpu import _thread_cpu

    before, t0 = _thread_cpu(), time.thread_time()
    while time.thread_time() - t0 < 0.3:  # 0.3 s of CPU on this thread
        pass
    grown = sum(_thread_cpu().values()) - sum(before.values())
    assert grown >= 0.25  # /proc counts in clock ticks (10 ms here)


def test_launch_names_the_failing_rank():
    res = launch("benchmarks.launch:selftest_worker", 2, {"fail_rank": 1}, timeout_s=60)
    assert not res.ok and res.failed_rank == 1
    assert "rank 1 of 2" in res.error and "fails on purpose" in res.error


def test_launch_kills_all_ranks_on_timeout():
    res = launch("benchmarks.launch:selftest_worker", 2, {"hang_rank": 0}, timeout_s=8)
    assert not res.ok and "timed out" in res.error
    assert all(c is not None for c in res.returncodes)  # nobody left running
    assert res.wall_s < 30


needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="network namespaces need root and iproute2")


@needs_netns
def test_cluster_is_created_and_always_removed():
    with pytest.raises(KeyboardInterrupt):
        with Cluster(2, ShapeConfig(rate_gbps=1.0)) as c:
            if not c.shaped:
                pytest.skip(f"namespaces not permitted here: {c.reason}")
            mine = [n for n in list_namespaces() if n.startswith(f"{PREFIX}{c.tag}-")]
            assert len(mine) == 3  # two ranks and the switch
            ping = subprocess.run(c.wrap(0, ["ip", "addr", "show", "dev", c.ifname]),
                                  capture_output=True, text=True, timeout=20)
            assert c.addr(0) in ping.stdout
            raise KeyboardInterrupt  # as Ctrl-C would
    assert not [n for n in list_namespaces() if n.startswith(f"{PREFIX}{os.getpid()}-")]


@needs_netns
def test_stale_namespaces_of_dead_runs_are_cleaned():
    name = f"{PREFIX}4194300-sw"  # a pid beyond any live process here
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=20)
    try:
        assert name in clean_stale()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)


def test_runner_reports_failures_without_stopping(tmp_path):
    bench_dir = tmp_path / "benches"
    bench_dir.mkdir()
    (bench_dir / "bench_good.py").write_text(
        "import sys\nfrom benchmarks.common import write_result\n"
        "out = sys.argv[sys.argv.index('--out') + 1]\n"
        "write_result(out, 'good', {'rows': [{'x': 1}], 'quick': '--quick' in sys.argv},"
        " '## good\\nok')\n")
    (bench_dir / "bench_bad.py").write_text("raise SystemExit('bench_bad: broken on purpose')\n")
    out = tmp_path / "out"
    # A re-run replaces the files of a benchmark's folder and keeps its subfolders (inputs).
    (out / "bad" / "inputs").mkdir(parents=True)
    (out / "bad" / "inputs" / "run.json").write_text("{}")
    (out / "bad" / "bad.json").write_text('{"rows": []}')  # an earlier run's result
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(out),
                           "--bench-dir", str(bench_dir), "--timeout", "60"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # one failed
    summary = (out / "summary.md").read_text()
    assert "## good" in summary and "broken on purpose" in summary
    assert "Machine:" in summary
    status = {b["name"]: b["status"] for b in json.loads((out / "summary.json").read_text())
              ["benchmarks"]}
    assert status["good"] == "ok" and status["bad"].startswith("failed")
    assert (out / "bad" / "inputs" / "run.json").exists()
    assert not (out / "bad" / "bad.json").exists()  # the failed run left no stale result
    assert (out / "good" / "good.json").exists() and (out / "good" / "good.log").exists()


def test_e2e_quick_runs_the_peers(tmp_path):
    from benchmarks import bench_e2e

    assert bench_e2e.main(["--quick", "--steps", "2", "--no-gradientflow",
                           "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "e2e.json").read_text())
    got = {r["variant"] for r in data["rows"] if "median_ms" in r}
    assert {"nocomm", "ddp", "fp16_hook", "powersgd"} <= got
    assert (tmp_path / "e2e.md").read_text().startswith("## End-to-end")


def test_runner_plots_wide_and_long_collectives_rows(tmp_path):
    from benchmarks.run import _size_bytes, plot_busbw

    assert _size_bytes("64 KB") == 65536 and _size_bytes("1MiB") == 2**20
    assert _size_bytes(4096) == 4096 and _size_bytes("huge") is None
    wide = {"rows": [{"op": "all_reduce", "size": s, "gloo busbw GB/s": b, "gf/gloo busbw": 1.0}
                     for s, b in (("4 KB", 0.1), ("1 MB", 0.9))]}
    long = {"rows": [{"label": "gloo", "bytes": 4096, "busbw_gbps": 1.0}]}
    for data in (wide, long):
        made = plot_busbw({"collectives": data}, tmp_path)
        assert made == ["summary_busbw.png"] and (tmp_path / made[0]).stat().st_size > 0
