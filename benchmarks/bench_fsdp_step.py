"""HSDP step time on 2 emulated hosts x 2 ranks: dense, CSC 1%, and the bound where the
replicate dimension sends nothing.

Four ranks in network namespaces (benchmarks/netem.py): each rank's NIC shaped to `--rate`
Gbit/s, ranks 0-1 and 2-3 joined by an unshaped host link. The mesh is (replicate 2, shard 2)
with each shard group inside a host, so the reduce-scatters and all-gathers stay on the host
link and only the replicate all-reduce crosses the shaped NICs. Every rank builds three copies
of the same MLP, each sharded with fully_shard on that mesh:

- "dense": plain HSDP, FSDP's own replicate all-reduce (FP32);
- "csc": the same, registered with CompressionConfig(density=0.01) (every other field its
  default, the warm-up included: the timed steps come after it);
- "bound": the replicate all-reduce replaced by a hook that sends nothing (its result is
  wrong; only its time matters): what any compression of the replicate dimension could reach.

After the warm-up steps, each rep steps the three once each, in turn, so a ratio compares steps
a few hundred milliseconds apart (benchmarks.common.paired_ratio: drift cancels); launches
repeat that. The collectives run on gloo (the transport under every variant alike).

    flock /work/timing.lock python benchmarks/bench_fsdp_step.py [--quick] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (machine_line, markdown_table, median,  # noqa: E402
                               paired_ratio, results_dir, write_result)

NAME = "fsdp_step"
VARIANTS = ("bound", "dense", "csc")


def _model(width: int, layers: int, mesh):
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*mods, torch.nn.Linear(width, 10))
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _send_nothing(model) -> None:
    """The bound: FSDP's replicate all-reduce off, a hook in its place that sends nothing."""
    from torch.distributed.fsdp import FSDPModule

    from gradientflow.hooks.fsdp import _shard_only

    for m in model.modules():
        if isinstance(m, FSDPModule):
            groups = m._get_fsdp_state()._fsdp_param_groups
            for pg in groups:
                _shard_only(pg)
            if groups:
                m.set_all_reduce_hook(lambda t: None)


def worker(rank: int, world: int, width: int, layers: int, warmup: int, reps: int) -> dict:
    """One rank: the three variants' step times (ms) of the timed reps, in turn."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import gradientflow.hooks as hooks
    from gradientflow.compression import CompressionConfig

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    models, opts = {}, {}
    for v in VARIANTS:
        models[v] = _model(width, layers, mesh)
        opts[v] = torch.optim.SGD(models[v].parameters(), lr=0.01, momentum=0.9)
    _send_nothing(models["bound"])
    state = hooks.register(models["csc"], CompressionConfig(density=0.01), optimizer=opts["csc"])
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(32, width, generator=gen)
    y = torch.randint(0, 10, (32,), generator=gen)

    def step(v: str) -> float:
        t0 = time.perf_counter()
        opts[v].zero_grad()
        torch.nn.functional.cross_entropy(models[v](x), y).backward()
        opts[v].step()
        return (time.perf_counter() - t0) * 1e3

    for _ in range(warmup):
        for v in VARIANTS:
            step(v)
    dist.barrier()
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(reps):
        for v in VARIANTS:
            times[v].append(step(v))
    stats = state.stats()["replicate"]
    return {"rank": rank, "times": times, "csc_steady": stats["steady"],
            "csc_wire_bytes_per_step": stats["wire_bytes_per_step"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small model, one short launch")
    ap.add_argument("--out", default=results_dir(NAME))
    ap.add_argument("--rate", type=float, default=1.0, help="NIC rate in Gbit/s")
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args(argv)
    from benchmarks.launch import launch
    from benchmarks.netem import Cluster, ShapeConfig

    width, layers, warmup = 1024, 4, 26  # the default warm-up ends after 25 steps
    launches, reps = args.launches, args.reps
    if args.quick:
        width, layers, warmup, launches, reps = 256, 2, 26, 1, 3
    world = 4
    load_before = "/".join(f"{x:.2f}" for x in os.getloadavg())
    per_launch = []
    where = ""
    for i in range(launches):
        with Cluster(world, ShapeConfig(rate_gbps=args.rate), hosts=(0, 0, 1, 1)) as cluster:
            where = cluster.describe()
            res = launch("benchmarks.bench_fsdp_step:worker", world,
                         dict(width=width, layers=layers, warmup=warmup, reps=reps),
                         cluster=cluster, timeout_s=900)
        if not res.ok:
            print(res.error)
            return 1
        r0 = res.results[0]
        if not r0["csc_steady"]:
            print("the CSC copy was still in its warm-up when timed")
            return 1
        per_launch.append(r0)
        print(f"launch {i + 1}: " + ", ".join(
            f"{v} {median(r0['times'][v]):.1f} ms" for v in VARIANTS), flush=True)
    rows = []
    for v in VARIANTS:
        meds = [median(r["times"][v]) for r in per_launch]
        ratio, lo, hi = paired_ratio([r["times"]["bound"] for r in per_launch],
                                     [r["times"][v] for r in per_launch])
        rows.append({"variant": v, "median_ms": median(meds), "launch_min_ms": min(meds),
                     "launch_max_ms": max(meds), "speed_vs_bound": ratio,
                     "speed_lo": lo, "speed_hi": hi})
    params = layers * (width * width + width) + width * 10 + 10
    md = "\n".join([
        "## HSDP step time: dense, CSC 1% and the communication-free bound",
        "",
        machine_line() + f" Load average {load_before} when it started.",
        "",
        f"2 emulated hosts x 2 ranks, {where}; mesh (replicate 2, shard 2), each shard group "
        f"inside a host. MLP of {layers} Linear({width}, {width}) layers and a head "
        f"({params:,} parameters), batch 32, SGD; gloo under every variant. {launches} "
        f"launches x {reps} reps after {warmup} warm-up steps, the three variants stepped in "
        "turn in each rep. Rank 0's step times; speed = bound's time / variant's time, the "
        "paired median over reps with its 95% bootstrap interval. CSC sent "
        f"{per_launch[0]['csc_wire_bytes_per_step']:.0f} bytes per step across the replicate "
        "dimension.",
        "",
        markdown_table(["variant", "median_ms", "launch_min_ms", "launch_max_ms",
                        "speed_vs_bound", "speed_lo", "speed_hi"], rows,
                       ["variant", "median ms", "launch min", "launch max",
                        "x as fast as the bound", "95% low", "95% high"]),
        "",
        "Command: `flock /work/timing.lock python benchmarks/bench_fsdp_step.py"
        f"{' --quick' if args.quick else ''}`",
    ])
    write_result(args.out, NAME, {"rows": rows, "launches": per_launch, "width": width,
                                  "layers": layers, "warmup": warmup, "reps": reps,
                                  "rate_gbps": args.rate}, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
