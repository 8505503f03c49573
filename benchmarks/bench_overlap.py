"""Overlap and scheduling: iteration time (p50, p95) of five ways to average gradients, paired.

    python -m benchmarks.bench_overlap [--quick] [--out DIR] [--width 1024 --depth 8 --batch 8]

Two ranks on loopback, one thread each, train the same wide MLP (comparable communication and
computation: both are printed) with:

- no overlap: backward, then one allreduce of all gradients (flattened), then SGD;
- DDP: torch DDP on the gradientflow group (its own buckets and hooks overlap with backward);
- FIFO overlap: DistributedOptimizer(priority=False), the default: partitions launched during
  backward in the order backward makes them ready, each routed as any async allreduce;
- priority: DistributedOptimizer(priority=True): among the partitions one agreement round
  finds issued on every rank, the one the next forward needs first goes first (TicTac's TIC
  order);
- FIFO + next forward / priority + next forward: as FIFO / priority, and step() returns at
  once; each layer is updated just before the next forward uses it (forward pre-hooks wait per
  layer). The pair shows what the order buys: the next forward needs the first layer first,
  and backward makes it ready last.

The variants run in interleaved blocks (A B C D E A B C D E ...) so drift in the machine's load
spreads over all of them; medians and 95th percentiles are over every timed iteration of rank 0.
"""
from __future__ import annotations

import argparse
import sys
import time

from benchmarks.common import (
    machine_info,
    machine_line,
    markdown_table,
    median,
    p95,
    results_dir,
    write_result,
)
from benchmarks.launch import launch

# The last variant is "priority" with two layers per partition (4 partitions instead of 9): what
# coarser partitions save here (fewer agreement rounds and messages) and what they cost (a larger
# last transfer after backward, less for priority to reorder).
COARSE = "priority, 2 layers/partition"
VARIANTS = ["no overlap", "DDP", "FIFO overlap", "priority", "FIFO + next forward",
            "priority + next forward", COARSE]


def worker(rank: int, world: int, width: int, depth: int, batch: int, blocks: int,
           steps_per_block: int, partition_bytes: int) -> dict:
    """One rank: every variant trained in interleaved blocks; per-iteration times."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradientflow  # registers the backend
    import gradientflow.optim as gfo

    gf = dist.new_group(backend="gradientflow")
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    base = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))
    nparams = sum(p.numel() for p in base.parameters())
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, width, generator=g)
    y = torch.randn(batch, 1, generator=g)

    def make(variant):
        model = copy.deepcopy(base)
        sgd = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        if variant == "no overlap":
            return model, sgd
        if variant == "DDP":
            model = DDP(model, process_group=gf)
            return model, torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        # Two layers and a little room, so the 4 KB head joins the last pair.
        coarse_bytes = 2 * (width + 1) * width * 4 + (64 << 10)
        return model, gfo.DistributedOptimizer(
            sgd, named_parameters=model.named_parameters(), process_group=gf,
            partition_bytes=coarse_bytes if variant == COARSE else partition_bytes,
            priority=not variant.startswith("FIFO"),
            overlap_next_forward=variant.endswith("next forward"))

    setups = {v: make(v) for v in VARIANTS}

    def one_step(variant):
        model, opt = setups[variant]
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if variant == "no overlap":
            grads = [p.grad for p in model.parameters()]
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=gf)
            flat.div_(world)
            for gr, new in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                gr.copy_(new)
        opt.step()

    # Calibration: what one step computes and what it sends, each alone.
    model0, _ = setups["no overlap"]

    def compute_only():
        model0.zero_grad()
        torch.nn.functional.mse_loss(model0(x), y).backward()

    flat = torch.zeros(nparams)

    def comm_only():
        dist.all_reduce(flat, group=gf)

    for fn in (compute_only, comm_only):
        fn()
    dist.barrier(group=gf)
    calib = {}
    for name, fn in (("compute_ms", compute_only), ("comm_ms", comm_only)):
        ts = []
        for _ in range(max(3, steps_per_block)):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        calib[name] = median(ts) * 1e3

    for v in VARIANTS:  # warm-up: first-step allocations, buffers and DDP start-up
        for _ in range(2):
            one_step(v)
        opt = setups[v][1]
        if hasattr(opt, "finish_updates"):
            opt.finish_updates()
    times = {v: [] for v in VARIANTS}
    cpu = {v: [] for v in VARIANTS}  # process CPU time (every thread of this rank)
    rounds = dict.fromkeys(VARIANTS, 0)  # the engine's agreement rounds (every kind)
    for _ in range(blocks):
        for v in VARIANTS:
            dist.barrier(group=gf)
            opt = setups[v][1]
            r0 = gradientflow.stats()["agreement_rounds"]
            for i in range(steps_per_block):
                t0, c0 = time.perf_counter(), time.process_time()
                one_step(v)
                if i == steps_per_block - 1 and hasattr(opt, "finish_updates"):
                    opt.finish_updates()  # the deferred update of the last step counts too
                times[v].append(time.perf_counter() - t0)
                cpu[v].append(time.process_time() - c0)
            rounds[v] += gradientflow.stats()["agreement_rounds"] - r0
    return {"rank": rank, "times": times, "cpu": cpu, "calib": calib, "nparams": nparams,
            "rounds": rounds,
            "partitions": len(setups["priority"][1].plan),
            "coarse_partitions": len(setups[COARSE][1].plan)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    ap.add_argument("--out", default=results_dir("overlap"), help="directory for overlap.json/.md")
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--depth", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--blocks", type=int, default=None)
    ap.add_argument("--steps-per-block", type=int, default=None)
    # Default: one layer (weight and bias), so one partition per layer (9 for the default MLP,
    # the head included), enough for priority to reorder. The COARSE variant has two layers per
    # partition (4). At 4 MiB every 4 KiB bias became a partition of its own (16), each a round
    # and a message.
    ap.add_argument("--partition-bytes", type=int, default=None)
    args = ap.parse_args(argv)
    quick = args.quick
    kw = {"width": args.width or (256 if quick else 1024),
          "depth": args.depth or (3 if quick else 8),
          "batch": args.batch or 8,
          "blocks": args.blocks or (2 if quick else 8),
          "steps_per_block": args.steps_per_block or (3 if quick else 10),
          "partition_bytes": args.partition_bytes}
    if kw["partition_bytes"] is None:
        kw["partition_bytes"] = (kw["width"] + 1) * kw["width"] * 4
    res = launch("benchmarks.bench_overlap:worker", world_size=2, kwargs=kw,
                 timeout_s=120 if quick else 900, threads_per_rank=1)
    if not res.ok:
        print(res.error, file=sys.stderr)
        return 1
    r0 = res.results[0]
    rows = []
    base_p50 = median(r0["times"]["no overlap"])
    for v in VARIANTS:
        ts = r0["times"][v]
        rows.append({"variant": v, "p50 ms": median(ts) * 1e3, "p95 ms": p95(ts) * 1e3,
                     "p95/p50": p95(ts) / median(ts),
                     "speed-up vs no overlap": base_p50 / median(ts),
                     "CPU ms/it": median(r0["cpu"][v]) * 1e3, "iterations": len(ts)})
    cal = r0["calib"]
    table = markdown_table(list(rows[0]), rows)
    prio = next(r for r in rows if r["variant"] == "priority")
    fifo = next(r for r in rows if r["variant"] == "FIFO overlap")
    nf = next(r for r in rows if r["variant"] == "priority + next forward")
    fnf = next(r for r in rows if r["variant"] == "FIFO + next forward")
    ddp = next(r for r in rows if r["variant"] == "DDP")
    per_iter = {v: r0["rounds"][v] / max(1, len(r0["times"][v])) for v in VARIANTS}
    coarse = next(r for r in rows if r["variant"] == COARSE)
    md = f"""## Overlap and priority scheduling (DistributedOptimizer)

`python -m benchmarks.bench_overlap{' --quick' if quick else ''}`: 2 ranks on loopback, one thread
each; MLP {kw['depth']} x {kw['width']}x{kw['width']} + head ({r0['nparams'] / 1e6:.2f} M
parameters, {r0['nparams'] * 4 / 1e6:.1f} MB of gradients, {r0['partitions']} partitions of
<= {kw['partition_bytes'] / 2**20:.3g} MiB; the last row:
{r0.get('coarse_partitions', '?')} partitions, two layers each), batch {kw['batch']}. Alone,
one forward+backward takes {cal['compute_ms']:.1f} ms and one allreduce of every gradient
{cal['comm_ms']:.1f} ms (rank 0 medians). {kw['blocks']} interleaved blocks of
{kw['steps_per_block']} iterations per variant.

{table}

Priority vs FIFO (p50 ratio, > 1: priority faster): {fifo['p50 ms'] / prio['p50 ms']:.2f}x when
step() waits for everything, {fnf['p50 ms'] / nf['p50 ms']:.2f}x with next-forward overlap.
FIFO vs no overlap: {fifo['speed-up vs no overlap']:.2f}x; priority vs no overlap:
{prio['speed-up vs no overlap']:.2f}x, vs DDP: {ddp['p50 ms'] / prio['p50 ms']:.2f}x; priority +
next forward vs no overlap: {nf['speed-up vs no overlap']:.2f}x, vs DDP:
{ddp['p50 ms'] / nf['p50 ms']:.2f}x. Priority with two layers per partition vs one:
{prio['p50 ms'] / coarse['p50 ms']:.2f}x (> 1: the coarser plan faster), vs no overlap
{coarse['speed-up vs no overlap']:.2f}x.
Agreement rounds per iteration (every round of the engine, DDP's too): DDP
{per_iter['DDP']:.1f}, FIFO {per_iter['FIFO overlap']:.1f}, priority {per_iter['priority']:.1f},
priority with two layers per partition {per_iter[COARSE]:.1f}.

How to read it. Every overlapped variant packs a partition on backward's thread as soon as its
last gradient arrives (divided by the world size as it is copied) and issues it as one
asynchronous allreduce into the group's one ordered stream, in backward's order on every rank
(one partition complete early waits for those after it); the thread that waits for it (step(),
or the next forward's pre-hook) unpacks it, so little Python competes with backward for the GIL.
The engine's agreement rounds close batches of the partitions every rank has issued (a batch
grows while a round is in flight, so partitions that become ready meanwhile travel together),
and a batch is sent in priority order: FIFO gives each partition its backward position, so a
batch leaves as issued; priority gives the first layer's partition the best, so of the
partitions agreed together it leaves first. When step() waits for every partition (FIFO,
priority), the order only decides which transfer ends last, not when the last one ends. The
order can pay when the next iteration can start before everything has arrived: backward makes
the first layer ready last, and the next forward needs it first (compare the two next-forward
rows). It can reorder only what one round agrees: a partition already handed to the transport
is not overtaken (gloo sends in order), which is why TicTac's gain (+19.2% throughput, GPU
workers with a NIC) needs the transfers to queue behind each other in a batch. TicTac's 2.3x
smaller straggler effect came from replacing a random, per-worker order by one order on every
worker; here the order is the same on every rank by construction, so there is no random-order
straggling to remove. On this
machine the two ranks share {machine_info()['nproc']} cores with their communication threads
(loopback copies and reductions are CPU work, and other jobs may load the machine: see the load
average below), so overlap competes with computation for the same cores, and the gains are
smaller and noisier than on GPUs with a NIC; p95/p50 shows the spread. CPU ms/it is rank 0's
process CPU time per iteration (every thread: computation, packing, gloo's threads, rounds),
the cost that other load on the cores distorts least.

{machine_line()}
"""
    write_result(args.out, "overlap", {"config": kw, "rows": rows, "calibration": cal,
                                       "ranks": res.results}, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
