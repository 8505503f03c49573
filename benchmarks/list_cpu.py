"""Where the fused list's CPU goes: the engine's default against the plugin floor, per thread.

On 2 cores shared by 2 ranks a list's time follows its CPU, so this times ResNet-50's 161
gradients as async allreduces on a gradientflow group with no options and on the plugin floor
(`fused_floor.py`: the same messages behind per-tensor calls into a Python backend that does
nothing else), alternately in the same processes, and per list reads: the wall time, the
process's CPU, the issuing loop's CPU on the caller's thread (the 161 calls, before the first
wait), and the CPU of each kind of thread (Python's threads, which include the caller, and
gloo's, by their names in /proc).

    python benchmarks/list_cpu.py [--launches 3] [--lists 20] [--lock /work/timing.lock]
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.check_cost import locked
from benchmarks.common import (markdown_table, results_dir, thread_cpu_seconds, timed_header,
                               write_result)
from benchmarks.launch import launch

VARIANTS = ("gf default", "plugin floor")


def _thread_cpu() -> dict:
    """CPU seconds so far of this process's threads by kind: Python's threads (the caller's
    included) as one, `python`, the others (gloo's) by the kernel's names for them."""
    return thread_cpu_seconds(lambda name: "python")


def worker(rank: int, world_size: int, lists: int) -> dict:
    """Per variant, per list: wall, process CPU, issuing CPU (ms), and CPU ms by thread name."""
    import torch
    import torch.distributed as dist

    from benchmarks import fused_floor
    from benchmarks.bench_fusion import gradient_shapes
    from gradientflow.backend.registry import backend_of

    torch.set_num_threads(1)
    gloo = dist.group.WORLD
    gf = dist.new_group(backend="gradientflow")
    cfg = backend_of(gf).config
    solo_gloo = dist.new_group(backend="gloo")
    dist.Backend.register_backend(fused_floor.NAME, fused_floor.creator(
        gloo, solo_gloo, cfg.fusion_threshold, cfg.solo_threshold), devices=["cpu"])
    groups = {"gf default": gf, "plugin floor": dist.new_group(backend=fused_floor.NAME)}
    grads = [torch.randn(s) for s in gradient_shapes("resnet50")][::-1]
    out = {k: {"wall": [], "cpu": [], "issue": [], "threads": collections.Counter()}
           for k in groups}
    for i in range(lists + 2):  # two lists each to warm up, not recorded
        for name in (VARIANTS if i % 2 == 0 else VARIANTS[::-1]):
            dist.barrier(group=gloo)
            th0 = _thread_cpu()
            t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
            works = [dist.all_reduce(g, group=groups[name], async_op=True) for g in grads]
            m1 = time.thread_time()
            for w in works:
                w.wait()
            t1, c1 = time.perf_counter(), time.process_time()
            th1 = _thread_cpu()
            if i >= 2:
                rec = out[name]
                rec["wall"].append((t1 - t0) * 1e3)
                rec["cpu"].append((c1 - c0) * 1e3)
                rec["issue"].append((m1 - m0) * 1e3)
                for k, v in th1.items():
                    rec["threads"][k] += (v - th0.get(k, 0.0)) * 1e3 / lists
    return {k: {**v, "threads": dict(v["threads"])} for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--lists", type=int, default=20, help="timed lists per variant and launch")
    ap.add_argument("--lock", default=None, help="a lock file shared with other timing jobs")
    ap.add_argument("--out", default=results_dir("list_cpu"))
    args = ap.parse_args()
    runs, loads = [], []
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    with locked(args.lock):
        for _ in range(args.launches):
            loads.append(os.getloadavg()[0])
            res = launch("benchmarks.list_cpu:worker", 2, kwargs={"lists": args.lists},
                         timeout_s=900)
            if not res.ok:
                raise SystemExit(res.error)
            runs.extend(res.results)  # both ranks: each is a sample of the same work
    rows = []
    for name in VARIANTS:
        per = [r[name] for r in runs]
        names = sorted({k for p in per for k in p["threads"]})
        rows.append({
            "variant": name,
            "wall ms": statistics.median(statistics.median(p["wall"]) for p in per),
            "process CPU ms": statistics.median(statistics.median(p["cpu"]) for p in per),
            "issuing CPU ms (161 calls)": statistics.median(
                statistics.median(p["issue"]) for p in per),
            **{f"{k} threads CPU ms": statistics.median(p["threads"].get(k, 0.0) for p in per)
               for k in names}})
    md = (f"## The fused ResNet-50 list's CPU: the engine's default against the plugin floor\n\n"
          f"{timed_header(started, loads)}\n\n"
          f"2 ranks on loopback, the two variants alternated list by list in the same processes "
          f"({args.lists} lists each per launch, {args.launches} launches). Per list, medians "
          "over the lists of a launch, then over launches and ranks; thread CPU by the thread "
          "names of /proc (`python`: every Python thread, the caller's included; `gloo_tcp_loop`,"
          " `pt_gloo_runloop`: gloo's):\n\n" + markdown_table(list(rows[0]), rows)
          + f"\n\nCommand: `python benchmarks/list_cpu.py --launches {args.launches} --lists "
          f"{args.lists}`\n")
    write_result(args.out, "list_cpu", {"runs": runs, "rows": rows, "loads": loads,
                                        "started": started}, md)
    print(md)


if __name__ == "__main__":
    main()
