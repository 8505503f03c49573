"""Plumbing of bench_e2e's gradientflow side: the DistributedOptimizer variant and the memory split.

Benchmarks are not tests: nothing here checks a speed. The one multi-process run is the quick
mode (tiny model, loopback), bounded by bench_e2e's own 90 s launch timeout.
"""
from __future__ import annotations

import json

from benchmarks import bench_e2e


def test_memory_split_keeps_the_anchors_and_fits_the_budget():
    group = ["nocomm", "ddp", *bench_e2e.GF_VARIANTS]
    # Unknown memory: one launch.
    assert bench_e2e._split_for_memory(group, 1000, 2, None) == [group]
    assert bench_e2e._split_for_memory(group, 1000, 2, 2**40) == [group]  # plenty: one launch
    params, ranks, avail = 61_100_840, 4, 20 * 2**30  # AlexNet, 4 ranks, 20 GiB free
    parts = bench_e2e._split_for_memory(group, params, ranks, avail)
    assert len(parts) > 1
    for part in parts:
        assert part[:2] == ["nocomm", "ddp"] and len(part) > 2
        need = sum(bench_e2e._BYTES_PER_PARAM[v] for v in part) * params
        assert need <= 0.6 * avail / ranks or len(part) == 3  # one variant alone always runs
    assert sorted(v for p in parts for v in p[2:]) == sorted(bench_e2e.GF_VARIANTS)


def test_targets_are_reported_as_met_or_not():
    base = {"model": "resnet50", "ranks": 2, "rate_gbps": 10.0}
    rows = [{**base, "variant": "ddp", "median_ms": 420.0, "speedup_vs_ddp": 1.0},
            {**base, "variant": "gf_csc1", "median_ms": 360.0, "speedup_vs_ddp": 420 / 360}]
    section = "\n".join(bench_e2e._targets_section(rows))
    csc = next(line for line in section.splitlines() if "CSC" in line and "10 Gbps" in line)
    ddp = next(line for line in section.splitlines() if "DDP gloo" in line and "10 Gbps" in line)
    assert csc.rstrip(" |").endswith("no")  # 1.17x measured against a 1.35x target
    assert ddp.rstrip(" |").endswith("no")  # 420 ms against 377 ms
    assert "why" not in section
    assert bench_e2e._met(rows[1], 1.1, True) == "yes" and bench_e2e._met(None, 1.1, True) == "-"


def test_e2e_quick_runs_the_distributed_optimizer(tmp_path):
    assert bench_e2e.main(["--quick", "--steps", "2", "--variants", "gf_opt,gf_csc1",
                           "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "e2e.json").read_text())["rows"]
    ran = {r["variant"] for r in rows if "median_ms" in r}
    assert {"nocomm", "ddp", "gf_opt", "gf_csc1"} <= ran, [r.get("skipped") for r in rows]
    assert "DistributedOptimizer, priority" in (tmp_path / "e2e.md").read_text()


def test_threshold_variants_get_their_own_group():
    assert bench_e2e._threshold_of("gf_csc1_unfused") == 0
    assert bench_e2e._threshold_of("gf_csc1_t32") == 32 * 2**20
    assert bench_e2e._threshold_of("gf_csc1") is None
    assert bench_e2e._threshold_of("gf_csc1_pool") is None


def test_pipeline_quick_counts_collectives_per_step(tmp_path):
    from benchmarks import bench_pipeline

    assert bench_pipeline.main(["--quick", "--out", str(tmp_path)]) == 0
    rows = {r["variant"]: r for r in json.loads((tmp_path / "pipeline.json").read_text())["rows"]}
    assert set(bench_pipeline.VARIANTS) <= set(rows), rows
    # tiny's gradients are one batch per step under the default threshold: CSC's 2 collectives;
    # unfused, every bucket makes its own 2
    assert rows["gf_csc1"]["collectives"] == 2.0, rows["gf_csc1"]
    assert rows["gf_csc1_unfused"]["collectives"] >= 2.0, rows["gf_csc1_unfused"]


def test_compression_budget_builds_and_times_every_config():
    """`make bench`'s compression budget: every config it times is one the current
    CompressionConfig accepts, and one tiny step of each runs."""
    from benchmarks import bench_compression as bc

    configs = bc.budget_configs(chunk_size=16)
    layouts = bc.ddp_buckets([("w", (40, 8)), ("b", (8,))], cap_mb=0.001)
    rows = bc.step_budget(configs, layouts, reps=1)
    assert [r["compressor"] for r in rows] == list(configs)
    assert all(r["wall_ms"] > 0 and r["buckets"] == len(layouts) for r in rows)


def test_pipeline_floor_adds_ddp_cost_error_feedback_and_wire_and_rebuilds_the_table(tmp_path):
    from benchmarks import bench_pipeline

    base = {"model": "m", "tier": "1 Gbps", "rate_gbps": 1.0, "ef_floor_ms": 15.0,
            "link_gbps": 0.8}
    rows = [{**base, "variant": "nocomm", "median_ms": 300.0, "comm_ms": 0.0},
            {**base, "variant": "ddp_noop", "median_ms": 305.0, "comm_ms": 5.0},
            {**base, "variant": "gf_csc1", "median_ms": 340.0, "comm_ms": 40.0,
             "wire_MB_per_step": 1.0},
            {**base, "model": "other", "variant": "gf_csc1", "median_ms": 1.0,
             "wire_MB_per_step": 1.0}]  # no limit of its own: left alone
    bench_pipeline.add_floor(rows)
    csc = rows[2]
    assert csc["wire_ms"] == 10.0  # 1 MB at the probed 0.8 Gbit/s, not the nominal 1
    assert csc["floor_ms"] == 5.0 + 15.0 + 10.0
    assert csc["best_of_limit"] == 300.0 / 330.0 and csc["best_hidden_of_limit"] == 300 / 320
    assert "floor_ms" not in rows[1] and "floor_ms" not in rows[3]
    # --table-only rebuilds the markdown from the JSON, keeping the run's command and machine
    (tmp_path / "pipeline.json").write_text(json.dumps(
        {"name": "pipeline", "machine": {"nproc": 9, "cpu": "x", "mem_gib": 1, "torch": "t",
                                         "python": "p", "kernel": "k"},
         "rows": rows[:3], "notes": [], "command": "python -m benchmarks.bench_pipeline --x"}))
    assert bench_pipeline.main(["--table-only", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "pipeline.md").read_text()
    assert "Machine: 9 cores" in md and "--x`" in md and "| 30.0 |" in md


def test_pipeline_launches_merge_to_medians_and_judge_the_median_speed():
    from benchmarks import bench_pipeline

    def launch(limit_ms, csc_ms):
        base = {"model": "m", "tier": "1 Gbps", "target": 0.9}
        return [{**base, "variant": "nocomm", "median_ms": limit_ms, "of_limit": 1.0},
                {**base, "variant": "gf_csc1", "median_ms": csc_ms,
                 "of_limit": limit_ms / csc_ms, "met": "yes" if limit_ms / csc_ms >= 0.9
                 else "no", "note": "kept", "shaped": True}]

    # speeds 0.80, 0.95, 0.92: the median (0.92) meets the target although one launch did not
    merged = bench_pipeline.merge_launches([launch(200, 250), launch(190, 200), launch(230, 250)])
    rows = {r["variant"]: r for r in merged}
    csc = rows["gf_csc1"]
    assert csc["median_ms"] == 250 and csc["launches"] == 3
    assert csc["of_limit"] == 0.92 and csc["met"] == "yes"
    assert csc["of_limit_each"] == "0.800, 0.950, 0.920"
    assert csc["note"] == "kept" and csc["shaped"] is True  # not numbers: the first launch's
    assert rows["nocomm"]["median_ms"] == 200
    # one launch: the rows as they were, plus the count
    (single,) = [r for r in bench_pipeline.merge_launches([launch(200, 250)])
                 if r["variant"] == "gf_csc1"]
    assert single["of_limit"] == 0.8 and single["met"] == "no" and single["launches"] == 1


def test_step_anatomy_tail_runs_from_the_steps_last_round_to_its_last_phase():
    from benchmarks.step_anatomy import tail_phases

    def x(name, ts, dur, cat="engine"):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}

    events = [{"ph": "i", "name": "step 0", "ts": 0.0}, {"ph": "i", "name": "step 1", "ts": 100e3},
              {"ph": "i", "name": "step 2", "ts": 200e3},
              x("compress", 10e3, 5e3),              # a bucket prepared during backward
              x("agree", 20e3, 1e3, "agree"),        # an earlier batch's round: not the tail
              x("agree", 60e3, 2e3, "agree"), x("allreduce", 62e3, 3e3, "comm"),
              x("decompress", 65e3, 1e3, "codec"),
              x("agree", 160e3, 4e3, "agree"), x("allreduce", 164e3, 5e3, "comm"),
              x("decompress", 170e3, 2e3, "codec"),
              x("step", 0.0, 100e3, "step")]        # step bars are not phases
    rows = tail_phases(events)
    assert [r["phase"] for r in rows] == ["agree", "allreduce", "decompress",
                                          "tail (round to last unpack)"]
    assert rows[0]["dur_ms"] == 3.0 and rows[1]["start_ms"] == 3.0  # medians over the 2 steps
    assert rows[2]["end_ms"] == 9.0 and rows[-1]["dur_ms"] == 9.0  # ends 6 and 12 ms
    assert all(r["steps"] == 2 for r in rows)
    assert tail_phases([e for e in events if e.get("name") != "agree"]) == []  # no round: none
