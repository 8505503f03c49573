"""End to end: a ResNet-50 DDP step under each collective algorithm, dense and CSC 1%.

One launch, every variant side by side in interleaved steps (the same load for all):

  - 4 workers as 2 hosts x 2 ranks. Every worker has its own NIC, shaped (tbf both ways, 1
    Gbit/s by default), and the two ranks of a host are also joined by an unshaped host link
    (benchmarks/netem.py `Cluster.hosts`): ring's ring uses it for two of its four hops,
    hierarchical for its reduce and broadcast, reduction_server not at all.
  - R reducers (python -m gradientflow.reducer), each in its own namespace on its own NIC,
    shaped like the workers'.
  - Variants: `nocomm` (the same step, no communication: the compute reference), then for each
    algorithm a DDP model on a gradientflow group of that algorithm, dense and with CSC at 1%
    (gradientflow.hooks.register, the public hook API; no dense warm-up: the target density).

Reported per variant: the median step time (a step ends when its slowest rank does), the
communication it adds over `nocomm`, the speed against ring with the same compression, the
bytes each rank's NIC sent and received per step (kernel counters, headers included), the
host link's bytes, and the bytes the algorithm's own counters (gradientflow.stats()) give.

    python benchmarks/bench_algorithms_e2e.py [--quick] [--out DIR] [--reducers 4]
        [--rate 1] [--warmup 3] [--steps 5] [--algorithms ring,hierarchical,reduction_server]

Run as root (namespaces). 4 ResNet-50 ranks and the reducers share this machine's cores, so a
step takes seconds: the defaults are 3 warm-up and 5 measured steps per variant.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_algorithms import (Placed, nic_counters, start_reducers,  # noqa: E402
                                         stop_reducers)
from benchmarks.common import machine_line, markdown_table, median, write_result  # noqa: E402
from benchmarks.launch import launch  # noqa: E402
from benchmarks.netem import HOST_LINK, NIC, Cluster, ShapeConfig  # noqa: E402

NAME = "algorithms_e2e"
ALGORITHMS = ("ring", "hierarchical", "reduction_server")
KINDS = ("dense", "csc1")
WORKERS = 4
HOST_OF = (0, 0, 1, 1)  # 2 hosts x 2 ranks
MODELS = {"resnet50": {"batch": 4, "image": 64}, "tiny": {"batch": 8, "image": 16}}


def _build_model(name: str):
    import torch

    torch.manual_seed(0)  # every variant starts from the same weights
    if name == "tiny":
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(), torch.nn.Linear(256, 10))
    import torchvision

    return getattr(torchvision.models, name)(weights=None)


def _algorithm_sent() -> tuple[int, int]:
    """(sent, received) bytes over every algorithm so far, from gradientflow.stats()."""
    import gradientflow

    algs = gradientflow.stats().get("algorithms", {})
    return (sum(a.get("sent_bytes", 0) for a in algs.values()),
            sum(a.get("recv_bytes", 0) for a in algs.values()))


def worker(rank: int, world_size: int, model: str, algorithms: list, reducers: int,
           reducer_prefixes: list, store_addr: str, log_dir: str, warmup: int, steps: int,
           group_timeout_s: float) -> dict:
    """One worker: build every variant, run them in interleaved steps; times and bytes."""
    procs = []
    if rank == 0 and "reduction_server" in algorithms:
        procs = start_reducers(world_size, reducer_prefixes, store_addr, log_dir)
    try:
        return _run_worker(rank, model, algorithms, reducers, warmup, steps, group_timeout_s)
    finally:
        stop_reducers(procs)


def _run_worker(rank, model, algorithms, reducers, warmup, steps, group_timeout_s) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradientflow.hooks as gfh
    from gradientflow.compression import CompressionConfig

    timeout = datetime.timedelta(seconds=group_timeout_s)
    runners = {"nocomm": _build_model(model)}
    for alg in algorithms:
        opts = {"algorithm": alg}
        if alg == "reduction_server":
            opts["reducers"] = reducers
        group = dist.new_group(backend="gradientflow", timeout=timeout, pg_options=opts)
        for kind in KINDS:
            ddp = DDP(_build_model(model), process_group=group)
            if kind == "csc1":
                gfh.register(ddp, CompressionConfig(method="csc", density=0.01,
                                                    warmup_densities=()))
            runners[f"{alg}/{kind}"] = ddp
    cfg = MODELS[model]
    torch.manual_seed(1 + rank)  # each rank its own data
    x = torch.randn(cfg["batch"], 3, cfg["image"], cfg["image"])
    y = torch.randint(0, 10, (cfg["batch"],))
    loss_fn = torch.nn.CrossEntropyLoss()
    optims = {v: torch.optim.SGD(m.parameters(), lr=1e-3) for v, m in runners.items()}

    def step(v: str) -> None:
        optims[v].zero_grad(set_to_none=False)
        loss_fn(runners[v](x), y).backward()
        optims[v].step()

    for v in runners:
        for _ in range(warmup):
            step(v)
    out = {v: {"s": [], "cpu": [], "nic_tx": 0, "nic_rx": 0, "host_tx": 0, "alg_sent": 0,
               "alg_recv": 0} for v in runners}
    for _ in range(steps):  # interleaved: step i of every variant, then step i + 1
        for v in runners:
            dist.barrier()
            nic0, host0, alg0 = nic_counters(NIC), nic_counters(HOST_LINK), _algorithm_sent()
            t0, c0 = time.perf_counter(), time.process_time()
            step(v)
            o = out[v]
            o["s"].append(time.perf_counter() - t0)
            o["cpu"].append(time.process_time() - c0)
            # DDP's last bucket is reduced within backward and the hooks' futures are waited
            # on before step() returns: every byte of this step has left by now.
            nic1, host1, alg1 = nic_counters(NIC), nic_counters(HOST_LINK), _algorithm_sent()
            o["nic_tx"] += nic1[0] - nic0[0]
            o["nic_rx"] += nic1[1] - nic0[1]
            o["host_tx"] += host1[0] - host0[0]
            o["alg_sent"] += alg1[0] - alg0[0]
            o["alg_recv"] += alg1[1] - alg0[1]
    params = sum(p.numel() for p in runners["nocomm"].parameters())
    dist.barrier()
    return {"variants": out, "params": params, "steps": steps}


def summarise(results: list[dict], shaped: bool) -> list[dict]:
    """One row per variant from every worker's result."""
    r0 = results[0]
    steps = r0["steps"]
    d = r0["params"] * 4
    rows = []
    for v in r0["variants"]:
        per_step = [max(ts) for ts in zip(*(r["variants"][v]["s"] for r in results))]

        def per_rank(key: str, pick=None) -> float:
            # mean over ranks: under ring and hierarchical the ranks' NICs carry different
            # loads (the hops inside a host take the host link); the max is the busiest NIC
            vals = [r["variants"][v][key] / steps for r in results]
            return (pick or (lambda x: sum(x) / len(x)))(vals)

        alg, _, kind = v.partition("/")
        rows.append({
            "variant": v, "algorithm": alg, "kind": kind or "-",
            "median_ms": median(per_step) * 1e3, "min_ms": min(per_step) * 1e3,
            "max_ms": max(per_step) * 1e3,
            "cpu_ms": sum(median(r["variants"][v]["cpu"]) for r in results) / len(results)
            * 1e3,
            "nic_tx_MB": per_rank("nic_tx") / 1e6 if shaped else None,
            "nic_rx_MB": per_rank("nic_rx") / 1e6 if shaped else None,
            "nic_tx_D": per_rank("nic_tx") / d if shaped else None,
            "busiest_nic_tx_D": per_rank("nic_tx", max) / d if shaped else None,
            "host_link_tx_MB": per_rank("host_tx") / 1e6 if shaped else None,
            "counted_sent_MB": per_rank("alg_sent") / 1e6,
            "counted_recv_MB": per_rank("alg_recv") / 1e6,
            "D_MB": d / 1e6})
    by = {r["variant"]: r for r in rows}
    ref = by.get("nocomm")
    for r in rows:
        if ref is not None and r is not ref:
            r["comm_ms"] = max(0.0, r["median_ms"] - ref["median_ms"])
        ring = by.get(f"ring/{r['kind']}")
        if ring is not None and r["algorithm"] != "nocomm":
            r["speed_vs_ring"] = ring["median_ms"] / r["median_ms"]
    return rows


def run(model: str, algorithms: list, reducers: int, rate: float | None, warmup: int,
        steps: int, timeout_s: float, group_timeout_s: float) -> tuple[list[dict], str, str]:
    """One launch; returns (rows, error, what the network was)."""
    uses_rs = "reduction_server" in algorithms
    extra = reducers if uses_rs else 0
    hosts = HOST_OF + tuple(2 + j for j in range(extra))
    log_dir = tempfile.mkdtemp(prefix="gfb-reducers-")
    with Cluster(WORKERS + extra, ShapeConfig(rate_gbps=rate), hosts=hosts) as cluster:
        placed = Placed(cluster, list(range(WORKERS)), host_of=list(HOST_OF))
        prefixes = [cluster.wrap(WORKERS + j, []) for j in range(extra)]
        res = launch("benchmarks.bench_algorithms_e2e:worker", WORKERS,
                     {"model": model, "algorithms": algorithms, "reducers": reducers,
                      "reducer_prefixes": prefixes, "store_addr": cluster.master_addr,
                      "log_dir": log_dir, "warmup": warmup, "steps": steps,
                      "group_timeout_s": group_timeout_s},
                     cluster=placed, timeout_s=timeout_s)
        where = cluster.describe() + ("; ranks 0-1 and 2-3 also share an unshaped host link"
                                      if cluster.shaped else "")
        if not res.ok:
            return [], f"{res.error} (reducers' logs in {log_dir})", where
        return summarise(res.results, cluster.shaped), "", where


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="a small conv net, 1 reducer, 1 warm-up and 2 measured steps")
    ap.add_argument("--out", default="benchmarks/results/algorithms_e2e")
    ap.add_argument("--model", default="resnet50", choices=sorted(MODELS))
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS))
    ap.add_argument("--reducers", type=int, default=4)
    ap.add_argument("--rate", default="1", help="NIC rate in Gbit/s ('none': unshaped)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=540.0, help="seconds for the launch")
    args = ap.parse_args(argv)
    algorithms = [a for a in args.algorithms.split(",") if a]
    unknown = sorted(set(algorithms) - set(ALGORITHMS))
    if unknown:
        ap.error(f"unknown algorithm(s) {unknown}: use {','.join(ALGORITHMS)}")
    model, reducers, warmup, steps = args.model, args.reducers, args.warmup, args.steps
    if args.quick:
        model, reducers, warmup, steps = "tiny", 1, 1, 2
    rate = None if args.rate.lower() == "none" else float(args.rate)
    t0 = time.monotonic()
    rows, error, where = run(model, algorithms, reducers, rate, warmup, steps, args.timeout,
                             group_timeout_s=120.0)
    wall = time.monotonic() - t0
    cols = ["variant", "median_ms", "min_ms", "max_ms", "comm_ms", "speed_vs_ring", "cpu_ms",
            "nic_tx_MB", "nic_rx_MB", "nic_tx_D", "busiest_nic_tx_D", "host_link_tx_MB",
            "counted_sent_MB",
            "counted_recv_MB"]
    cmd = "python benchmarks/bench_algorithms_e2e.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    md = [f"## {model} DDP step per algorithm, {WORKERS} workers, "
          f"{ShapeConfig(rate_gbps=rate).label}", "",
          machine_line(), "",
          f"`{cmd.strip()}`: {warmup} warm-up and {steps} measured steps per variant, "
          "interleaved; medians of the step time (slowest rank); bytes per rank per step "
          "(means over ranks; busiest: the rank whose NIC sent most). D = the model's FP32 "
          f"gradient. {wall:.0f} s.", "",
          f"Network: {where}. reduction_server: {reducers} reducer(s), each on its own NIC.",
          "The machine's 2 cores are shared with other jobs: compare within this table.", ""]
    if error:
        md += [f"**Failed:** {error}", ""]
    else:
        md += [markdown_table(cols, rows), ""]
    text = "\n".join(md)
    print(text)
    write_result(args.out, NAME, {"command": cmd.strip(), "model": model, "rows": rows,
                                  "error": error, "network": where, "reducers": reducers,
                                  "warmup": warmup, "steps": steps, "wall_s": wall}, text)
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())
