"""What the always-on collective check costs: gradientflow against gloo in the same processes.

Three measurements, each over `--runs` launches of 2 ranks on loopback, interleaved:

- **calls**: synchronous `all_reduce` of 4 KB and 1 MB, each rep timed on a gradientflow group
  and on a gloo group of the same processes, alternately (same machine load for both);
- **beside**: a gloo group's 4 KB `all_reduce` in processes that hold no gradientflow group,
  and in processes that hold one (idle), launches alternating A B A B;
- **fused**: the ResNet-50 gradient list, 161 async allreduces per step, fused by default
  against DDP-style 25 MB buckets (`bench_fusion.py`), `--fusion-runs` launches.

    python benchmarks/check_cost.py [--runs 5] [--fusion-runs 3] [--lock /work/timing.lock]

Each table gives the median over launches and the spread (min-max) of the per-launch ratios.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (fmt, markdown_table, results_dir, time_calls, timed_header,
                               write_result)
from benchmarks.launch import launch

HERE = Path(__file__).resolve().parent.parent
SIZES = (4096, 1 << 20)
FUSION = ["--models", "resnet50", "--worlds", "2", "--tiers", "none", "--thresholds", "128",
          "--solos", "4", "--cycles", "3", "--reps", "11", "--launches", "1"]


def calls_worker(rank: int, world_size: int, reps: int, sizes: list) -> dict:
    """Per size: every rep times one gloo call and one gradientflow call, alternately."""
    import torch
    import torch.distributed as dist

    import gradientflow  # noqa: F401 - registers the backend before torch 2.14

    torch.set_num_threads(1)
    groups = {"gloo": dist.group.WORLD, "gradientflow": dist.new_group(backend="gradientflow")}
    out = {}
    for size in sizes:
        x = torch.ones(size // 4)
        times: dict = {k: [] for k in groups}
        for g in groups.values():
            for _ in range(20):
                dist.all_reduce(x, group=g)
        for i in range(reps):
            order = list(groups.items()) if i % 2 == 0 else list(groups.items())[::-1]
            for name, g in order:
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(x, group=g)
                times[name].append(time.perf_counter() - t0)
        out[str(size)] = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return out


def beside_worker(rank: int, world_size: int, reps: int, with_gf: bool) -> dict:
    """A gloo group's 4 KB all_reduce, with or without an (idle) gradientflow group beside it."""
    import torch
    import torch.distributed as dist

    import gradientflow  # noqa: F401 - imported in both arms: only the group differs

    torch.set_num_threads(1)
    if with_gf:
        g = dist.new_group(backend="gradientflow")
        dist.all_reduce(torch.ones(1024), group=g)  # connected and used once
    x = torch.ones(1024)
    times = time_calls(lambda: dist.all_reduce(x), reps, warmup=20, before=dist.barrier)
    return {"gloo_ms": statistics.median(times) * 1e3}


@contextlib.contextmanager
def locked(path: str | None):
    """Hold an exclusive flock on `path` (other timing jobs wait), or nothing."""
    if not path:
        yield
        return
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _spread(values: list) -> str:
    return f"{fmt(min(values))}-{fmt(max(values))}"


def _run(target: str, **kwargs) -> list:
    res = launch(f"benchmarks.check_cost:{target}", 2, kwargs=kwargs, timeout_s=600)
    if not res.ok:
        raise RuntimeError(f"{target}: {res.error}")
    return res.results


def fusion_run(out: Path) -> dict:
    """One bench_fusion launch on loopback; its loopback row."""
    cmd = [sys.executable, str(HERE / "benchmarks" / "bench_fusion.py"), *FUSION,
           "--out", str(out)]
    with open(out.with_suffix(".log"), "w") as fh:
        subprocess.run(cmd, cwd=HERE, stdout=fh, stderr=subprocess.STDOUT, check=True,
                       timeout=1800)
    data = json.loads(next(out.glob("*.json")).read_text())
    return next(r for r in data["rows"] if r.get("tier") == "loopback")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="launches per measurement")
    ap.add_argument("--reps", type=int, default=300, help="timed calls per launch and size")
    ap.add_argument("--fusion-runs", type=int, default=3)
    ap.add_argument("--lock", default=None, help="a lock file shared with other timing jobs")
    ap.add_argument("--out", type=Path, default=Path(results_dir("check_cost")))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    calls, beside, fused, loads = [], {True: [], False: []}, [], []
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    with locked(args.lock):
        for i in range(args.runs):
            loads.append(os.getloadavg()[0])
            calls.append(_run("calls_worker", reps=args.reps, sizes=list(SIZES))[0])
            for with_gf in ((False, True) if i % 2 == 0 else (True, False)):
                beside[with_gf].append(
                    _run("beside_worker", reps=args.reps, with_gf=with_gf)[0]["gloo_ms"])
            print(f"run {i + 1}/{args.runs} done (load {loads[-1]:.1f})", flush=True)
        for i in range(args.fusion_runs):
            loads.append(os.getloadavg()[0])
            fused.append(fusion_run(args.out / f"fusion_{i + 1}"))
    goals = {4096: 1.3, 1 << 20: 1.1}
    rows = []
    for size in SIZES:
        ratios = [c[str(size)]["gradientflow"] / c[str(size)]["gloo"] for c in calls]
        rows.append({"all_reduce": f"{size // 1024} KB" if size < 1 << 20 else "1 MB",
                     "gloo ms": statistics.median(c[str(size)]["gloo"] for c in calls),
                     "gradientflow ms": statistics.median(c[str(size)]["gradientflow"]
                                                          for c in calls),
                     "ratio (median)": statistics.median(ratios), "spread": _spread(ratios),
                     "goal": f"<= {goals[size]}x",
                     "verdict": "met" if statistics.median(ratios) <= goals[size] else "missed"})
    side = [b / a for a, b in zip(beside[False], beside[True])]
    brow = [{"gloo 4 KB ms, alone": statistics.median(beside[False]),
             "beside a gradientflow group": statistics.median(beside[True]),
             "ratio (median)": statistics.median(side), "spread": _spread(side)}]
    frow = [{"default ms": statistics.median(f["default ms"] for f in fused),
             "buckets ms": statistics.median(f["gloo 25MB buckets ms"] for f in fused),
             "buckets / default (median)": statistics.median(f["buckets / default"]
                                                            for f in fused),
             "spread": _spread([f["buckets / default"] for f in fused]),
             "goal": ">= 1.35",
             # The bounds beside it, from the same launches (bench_fusion's module doc).
             "buckets / plugin floor (median)": statistics.median(
                 f["buckets / plugin floor"] for f in fused),
             "plugin floor spread": _spread([f["buckets / plugin floor"] for f in fused]),
             "buckets / hand-fused (median)": statistics.median(
                 f["buckets / hand-fused"] for f in fused)}
            ] if fused else []
    md = (f"## The always-on check's cost: gradientflow against gloo, side by side\n\n"
          f"{timed_header(started, loads)}\n\n"
          f"Synchronous `all_reduce`, 2 ranks on loopback, a gloo group and a gradientflow "
          f"group in the same processes, timed alternately ({args.reps} reps each, per-launch "
          f"medians; median and spread over {args.runs} launches):\n\n"
          + markdown_table(list(rows[0]), rows) +
          "\n\nA gloo group's 4 KB `all_reduce` in processes without and with an idle "
          f"gradientflow group (launches alternating, {args.runs} each):\n\n"
          + markdown_table(list(brow[0]), brow)
          + ("\n\nThe fused path: ResNet-50's 161 gradients as async allreduces, fused by "
             f"default, against DDP-style 25 MB buckets (`bench_fusion.py {' '.join(FUSION)}`, "
             f"{args.fusion_runs} launches):\n\n" + markdown_table(list(frow[0]), frow)
             if frow else "")
          + f"\n\nCommand: `python benchmarks/check_cost.py --runs {args.runs} --reps "
          f"{args.reps} --fusion-runs {args.fusion_runs}`\n")
    write_result(args.out, "check_cost", {"calls": calls, "beside": {
        "alone": beside[False], "with_gf": beside[True]}, "fused": fused, "loads": loads,
        "rows": rows, "started": started}, md)
    print(md)


if __name__ == "__main__":
    main()
