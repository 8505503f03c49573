"""nccl-tests style table: gradientflow vs plain gloo, synchronous collectives, side by side.

Every rank holds a gloo world group and a gradientflow group over the same ranks; for each
op and size the two are timed alternately, rep by rep, so both see the same machine load.
busbw follows nccl-tests: allreduce 2(n-1)/n, all_gather and reduce_scatter (n-1)/n,
broadcast 1, times the algorithm bandwidth (bytes / time).

    python benchmarks/bench_collectives.py [--quick] [--out DIR] [--sizes 4096,65536 --reps 50]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import fmt, machine_line, markdown_table, median, results_dir, write_result
from benchmarks.launch import launch

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def _bus_factor(op: str, n: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
            "reduce_scatter": (n - 1) / n, "broadcast": 1.0}[op]


def worker(rank: int, world_size: int, sizes: list[int], reps: int) -> dict:
    """Time every (op, size) on gloo and on gradientflow, alternating rep by rep."""
    import time

    import torch
    import torch.distributed as dist

    import gradientflow  # noqa: F401

    torch.set_num_threads(1)
    groups = {"gloo": dist.group.WORLD, "gradientflow": dist.new_group(backend="gradientflow")}
    out: dict = {}
    for op in OPS:
        for size in sizes:
            numel = max(1, size // 4)
            per = max(1, numel // world_size)
            x = torch.ones(numel)
            shard = torch.ones(per)
            full = torch.ones(per * world_size)

            def call(g, op=op, x=x, full=full, shard=shard):
                if op == "all_reduce":
                    dist.all_reduce(x, group=g)
                elif op == "all_gather":
                    dist.all_gather_into_tensor(full, shard, group=g)
                elif op == "reduce_scatter":
                    dist.reduce_scatter_tensor(shard, full, group=g)
                else:
                    dist.broadcast(x, src=0, group=g)

            times = {k: [] for k in groups}
            r = reps if size < 2**24 else max(3, reps // 4)
            for i in range(r + 1):
                for name, g in groups.items():
                    dist.barrier(group=groups["gloo"])
                    t0 = time.perf_counter()
                    call(g)
                    dt = time.perf_counter() - t0
                    if i:  # the first rep warms buffers and connections up
                        times[name].append(dt)
            out[f"{op}:{size}"] = {k: median(v) for k, v in times.items()}
    return out


def _label(size: int) -> str:
    for unit, div in (("MB", 2**20), ("KB", 2**10)):
        if size >= div:
            return f"{size // div} {unit}"
    return f"{size} B"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 KB-1 MB, 2 ranks, few reps")
    ap.add_argument("--out", default=results_dir("collectives"))
    ap.add_argument("--worlds", default=None, help="comma-separated world sizes")
    ap.add_argument("--sizes", default=None,
                    help="comma-separated message sizes in bytes (e.g. 4096,65536: the per-call "
                         "cost of small collectives)")
    ap.add_argument("--reps", type=int, default=None, help="timed reps per op and size")
    args = ap.parse_args(argv)
    if args.quick:
        sizes, worlds, reps = [2**12, 2**16, 2**20], [2], 5
    else:
        sizes = [2**k for k in range(12, 29, 2)]  # 4 KB .. 256 MB
        worlds, reps = [2, 4], 20
    if args.worlds:
        worlds = [int(w) for w in args.worlds.split(",")]
    if args.sizes:
        sizes = [int(x) for x in args.sizes.split(",")]
    reps = args.reps or reps
    rows, raw = [], {}
    for n in worlds:
        res = launch("benchmarks.bench_collectives:worker", world_size=n,
                     kwargs={"sizes": sizes, "reps": reps}, timeout_s=1800)
        if not res.ok:
            print(res.error)
            return 1
        r0 = res.results[0]
        raw[n] = r0
        for op in OPS:
            for size in sizes:
                t = r0[f"{op}:{size}"]
                bus = {k: size / v * _bus_factor(op, n) / 1e9 for k, v in t.items()}
                rows.append({"ranks": n, "op": op, "size": _label(size),
                             "gloo ms": t["gloo"] * 1e3, "gf ms": t["gradientflow"] * 1e3,
                             "gloo busbw GB/s": bus["gloo"], "gf busbw GB/s": bus["gradientflow"],
                             "gf/gloo busbw": bus["gradientflow"] / bus["gloo"],
                             "overhead us": (t["gradientflow"] - t["gloo"]) * 1e6})
    cols = ["ranks", "op", "size", "gloo ms", "gf ms", "gloo busbw GB/s", "gf busbw GB/s",
            "gf/gloo busbw", "overhead us"]
    big = [r["gf/gloo busbw"] for r in rows if not r["size"].endswith(("KB", " B"))]
    small = [r["overhead us"] for r in rows if r["size"] == _label(min(sizes))]
    summary = ("Synchronous collectives, medians."
               + (f" Across sizes >= 1 MB the median gf/gloo busbw ratio is {fmt(median(big))} "
                  f"(min {fmt(min(big))});" if big else "")
               + f" The per-call overhead at {_label(min(sizes))} is {fmt(median(small))} us "
               "(median over ops and world sizes).")
    md = (f"## Collectives: gradientflow vs gloo\n\n{machine_line()}\n\n{summary}\n\n"
          + markdown_table(cols, rows))
    print(md)
    write_result(args.out, "collectives", {"rows": rows, "raw": raw, "summary": summary}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
