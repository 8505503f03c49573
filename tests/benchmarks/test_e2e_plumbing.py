"""Plumbing of bench_e2e's gradientflow side: the DistributedOptimizer variant and the memory split.

Benchmarks are not tests: nothing here checks a speed. The one multi-process run is the quick
mode (tiny model, loopback), bounded by bench_e2e's own 90 s launch timeout.
"""
from __future__ import annotations

import json

from benchmarks import bench_e2e


def test_memory_split_keeps_the_anchors_and_fits_the_budget():
    group = ["nocomm", "ddp", *bench_e2e.GF_VARIANTS]
    assert bench_e2e._split_for_memory(group, 1000, 2, None) == [group]  # unknown memory: one launch
    assert bench_e2e._split_for_memory(group, 1000, 2, 2**40) == [group]  # plenty: one launch
    params, ranks, avail = 61_100_840, 4, 20 * 2**30  # AlexNet, 4 ranks, 20 GiB free
    parts = bench_e2e._split_for_memory(group, params, ranks, avail)
    assert len(parts) > 1
    for part in parts:
        assert part[:2] == ["nocomm", "ddp"] and len(part) > 2
        need = sum(bench_e2e._BYTES_PER_PARAM[v] for v in part) * params
        assert need <= 0.6 * avail / ranks or len(part) == 3  # one variant alone always runs
    assert sorted(v for p in parts for v in p[2:]) == sorted(bench_e2e.GF_VARIANTS)


def test_missed_target_reasons_follow_the_launch_anchors():
    def rows(nocomm, ddp, csc, floor=None):
        base = {"model": "resnet50", "ranks": 2, "rate_gbps": 10.0, "group": "gf"}
        return [{**base, "variant": v, "median_ms": ms, "extra_cpu_ms": 50.0, "ef_floor_ms": floor,
                 "speedup_vs_ddp": ddp / ms} for v, ms in
                (("nocomm", nocomm), ("ddp", ddp), ("gf_csc1", csc))]

    why = bench_e2e._why_missed
    r = rows(350, 1000, 400)  # limit 2.86x under a 3.2x target: compute-bound
    assert why(r, r[2], 3.2).startswith("compute-bound")
    r = rows(300, 420, 360, floor=13.0)  # limit 1.40x, but the floor caps it at 1.34x
    assert why(r, r[2], 1.35).startswith("out of reach here") and "1.34x" in why(r, r[2], 1.35)
    r = rows(300, 420, 360, floor=1.0)  # a floor that leaves room: the variant's own cost
    assert why(r, r[2], 1.35).startswith("kernel/CPU cost")
    r = rows(300, 420, 360)
    assert why(r, r[2], 1.1) == ""  # target met


def test_e2e_quick_runs_the_distributed_optimizer(tmp_path):
    assert bench_e2e.main(["--quick", "--steps", "2", "--variants", "gf_opt,gf_csc1",
                           "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "e2e.json").read_text())["rows"]
    ran = {r["variant"] for r in rows if "median_ms" in r}
    assert {"nocomm", "ddp", "gf_opt", "gf_csc1"} <= ran, [r.get("skipped") for r in rows]
    assert "DistributedOptimizer, priority" in (tmp_path / "e2e.md").read_text()
