"""Wire bytes of ResNet-50's gradient per compressor, and the time of one compress+reduce.

Wire bytes follow the one definition of gradientflow.compression.stats: every byte a rank hands
to a SUM allreduce for its gradients (CSC: the FP32 chunk-norm vector, the packed chunks and the
dense parameters). They are COUNTED by the compressors' own statistics while they run on a real
25,557,032-element gradient with torchvision resnet50's parameter shapes (the model is never
run), and checked against the arithmetic printed beside them.

Timing: one compress+reduce of that gradient for 2 ranks simulated in one process
(`drive_lockstep`: both ranks' compression work plus the summing a transport would do), per
compressor, median over repeats, all compressors side by side in each repeat; torch and the
numba kernels at `--threads` (1 by default).

Per-step budget: the work one rank's DDP hook does per ResNet-50 step (its 25 MB buckets, each
reduced by the compressor with the collectives replaced by the identity, so only compression is
timed), wall and CPU time (``time.process_time``: all of the process's threads, so it stays
meaningful when other processes share the cores), median over repeats, compressors interleaved.

Run: ``python -m benchmarks.bench_compression [--quick] [--out DIR]``
     ``python -m benchmarks.bench_compression --budget-only [--reps N]``   (the budget table only)
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import warnings

import torch

from gradientflow import kernels
from gradientflow.compression import CompressionConfig, CSCOptions, Layout, make_compressor
from gradientflow.engine.stages import drive, drive_lockstep

DDP_BUCKET_MB = 25  # DDP's default bucket_cap_mb


def resnet50_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every torchvision resnet50 parameter, built on the meta device."""
    import torchvision

    with torch.device("meta"):
        model = torchvision.models.resnet50()
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def ddp_buckets(shapes, cap_mb: float = DDP_BUCKET_MB) -> list[Layout]:
    """Split parameters as DDP does after its rebuild: reverse order, a bucket closes at cap."""
    cap = cap_mb * 2**20
    buckets, cur, size = [], [], 0
    for name, shape in reversed(shapes):
        cur.append((name, shape))
        size += 4 * math.prod(shape)
        if size >= cap:
            buckets.append(Layout.from_shapes(cur))
            cur, size = [], 0
    if cur:
        buckets.append(Layout.from_shapes(cur))
    return buckets


def one_step(cfg: CompressionConfig, layouts, world: int, grads=None, comps=None):
    """Run one step of `world` simulated ranks over the layouts.

    Returns (compressors, seconds, outputs).
    """
    comps = comps or [make_compressor(cfg, world) for _ in range(world)]
    flats = []
    for lay in layouts:
        if grads is None:
            gen = torch.Generator().manual_seed(lay.numel)
            flats.append([torch.randn(lay.numel, generator=gen) for _ in range(world)])
        else:
            flats.append([g.clone() for g in grads])
    t0 = time.perf_counter()
    outs = []
    for lay, per_rank in zip(layouts, flats):
        outs.append(drive_lockstep([c.reduce(f, lay) for c, f in zip(comps, per_rank)]))
    dt = time.perf_counter() - t0
    for c in comps:
        c.end_step()
    return comps, dt, outs


def step_budget(configs: dict, layouts, reps: int, world: int = 2) -> list[dict]:
    """Time one rank's compression work per step over `layouts` (the hook's buckets), per config.

    The collectives are the identity (`drive` with a no-op), so what is timed is exactly what the
    hook adds on the rank's core: residual add, norms, selection, packing, unpacking, residual
    update, finiteness tests, Python. Gradients are refilled before each step (not timed).
    Returns rows with median wall and CPU milliseconds; configs alternate step by step.
    """
    comps = {label: make_compressor(cfg, world) for label, cfg in configs.items()}
    gen = torch.Generator().manual_seed(0)
    src = [torch.randn(lay.numel, generator=gen) for lay in layouts]
    flats = [g.clone() for g in src]
    wall: dict[str, list[float]] = {label: [] for label in configs}
    cpu: dict[str, list[float]] = {label: [] for label in configs}
    for rep in range(reps + 2):  # two warm-up steps: compilation, residual and buffer allocation
        for label, comp in comps.items():
            for f, g in zip(flats, src):
                f.copy_(g)
            t0, c0 = time.perf_counter(), time.process_time()
            for lay, f in zip(layouts, flats):
                drive(comp.reduce(f, lay), lambda t: None)
            comp.end_step()
            if rep >= 2:
                wall[label].append(time.perf_counter() - t0)
                cpu[label].append(time.process_time() - c0)
    return [{"compressor": label, "wall_ms": 1e3 * statistics.median(wall[label]),
             "cpu_ms": 1e3 * statistics.median(cpu[label]), "min_wall_ms": 1e3 * min(wall[label]),
             "buckets": len(layouts)} for label in configs]


def budget_configs(density: float = 0.01, chunk_size: int = CSCOptions.chunk_size) -> dict:
    """The hook settings whose per-step cost the e2e benchmark depends on."""
    common = dict(chunk_size=chunk_size, warmup_densities=())
    return {
        "fp16 (error feedback)": CompressionConfig(method="fp16"),
        "fp16 (no error feedback)": CompressionConfig(method="fp16", error_feedback=False),
        f"csc {density:g} fp16": CompressionConfig(method="csc", density=density, **common),
        "csc 0.1 fp16": CompressionConfig(method="csc", density=0.1, **common),
    }


def arithmetic(n: int, d: int, chunk: int, density: float, wire_b: int, dense_b: int,
               norm_b: int = 4) -> dict:
    """The wire bytes of one CSC step on ONE flat buffer, from the formula."""
    nch = math.ceil(n / chunk)
    k = math.ceil(density * nch)
    norms, payload, dense = norm_b * nch, wire_b * k * chunk, dense_b * d
    return {"chunks": nch, "k": k, "norm_bytes": norms, "payload_bytes": payload,
            "dense_bytes": dense,
            "wire_bytes": norms + payload + dense, "ratio": 4 * n / (norms + payload + dense)}


def main(argv=None) -> int:
    """Measure, print the table and the arithmetic, write DIR/compression.{json,md}."""
    from benchmarks.common import results_dir

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer timing repeats")
    p.add_argument("--out", default=results_dir("compression"), help="output directory")
    p.add_argument("--reps", type=int, default=None, help="timing repeats (default 5, quick 2)")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--chunk-size", type=int, default=CSCOptions.chunk_size)
    p.add_argument("--budget-only", action="store_true",
                   help="only the per-step hook budget (one rank, ResNet-50's DDP buckets)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch and kernel threads (default 1: numba's pool and torch's fight over "
                        "2 cores, e.g. a 310k-element isfinite took 88 ms instead of 2.5 ms with "
                        "both at 2)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernels.set_num_threads(args.threads)
    reps = args.reps or (1 if args.quick else 5)
    world = 2
    warnings.simplefilter("ignore", RuntimeWarning)

    shapes = resnet50_shapes()
    if args.budget_only:
        from benchmarks.common import machine_line, markdown_table

        brows = step_budget(budget_configs(args.density, args.chunk_size), ddp_buckets(shapes),
                            args.reps or 9)
        print(f"Per-step hook budget, one rank, {kernels.get_num_threads()} kernel thread(s), "
              f"median of {args.reps or 9}:")
        print(markdown_table(["compressor", "buckets", "wall_ms", "cpu_ms", "min_wall_ms"], brows))
        print(machine_line())
        return 0
    whole = Layout.from_shapes(shapes)
    n = whole.numel
    cfg0 = CompressionConfig(chunk_size=args.chunk_size)
    d = sum(math.prod(s) for _, s in shapes if cfg0.is_dense_param(s))
    d1 = sum(math.prod(s) for _, s in shapes if len(s) <= 1)
    buckets = ddp_buckets(shapes)
    print(f"ResNet-50: {len(shapes)} tensors, {n:,} elements; {d1:,} in 1-D tensors; sent dense "
          f"by the default rule (dim <= 1 or numel < {cfg0.min_numel}): {d:,}; DDP buckets of "
          f"{DDP_BUCKET_MB} MB: {len(buckets)}")

    # --- wire bytes, counted by the compressors' statistics -------------------------------------
    common = dict(chunk_size=args.chunk_size, warmup_densities=())
    variants = {
        "dense fp32 (none)": CompressionConfig(method="none"),
        "fp16": CompressionConfig(method="fp16"),
        f"csc {args.density:g} fp16, dense part fp32": CompressionConfig(
            method="csc", density=args.density, dense_wire_dtype="fp32", **common),
        f"csc {args.density:g} fp16": CompressionConfig(
            method="csc", density=args.density, **common),
    }
    rows = []
    for label, cfg in variants.items():
        for lay_name, lays in (("one flat buffer", [whole]),
                               (f"DDP {DDP_BUCKET_MB} MB buckets", buckets)):
            comps, _, _ = one_step(cfg, lays, 1)
            s = comps[0].stats.as_dict()["steady"]
            rows.append({"compressor": label, "layout": lay_name, "wire_bytes": s["wire_bytes"],
                         "dense_fp32_bytes": s["dense_fp32_bytes"], "ratio": s["ratio"],
                         "chunks_sent": s["chunks_sent"] or None})
            del comps
    ar32 = arithmetic(n, d, args.chunk_size, args.density, 2, 4)
    ar16 = arithmetic(n, d, args.chunk_size, args.density, 2, 2)
    lines = [
        f"Arithmetic (one flat buffer, C = {args.chunk_size}, density {args.density:g}, "
        "FP32 norms):",
        f"  dense FP32 = 4 x {n:,} = {4 * n:,} B",
        f"  chunks = ceil({n:,} / {args.chunk_size}) = {ar16['chunks']:,}; k = "
        f"ceil({args.density:g} x chunks) = {ar16['k']:,}",
        f"  norms 4 x {ar16['chunks']:,} = {ar16['norm_bytes']:,} B; payload 2 x {ar16['k']:,} x "
        f"{args.chunk_size} = {ar16['payload_bytes']:,} B",
        f"  dense part FP32: 4 x {d:,} = {ar32['dense_bytes']:,} B -> {ar32['wire_bytes']:,} B, "
        f"{ar32['ratio']:.1f}x fewer",
        f"  dense part FP16: 2 x {d:,} = {ar16['dense_bytes']:,} B -> {ar16['wire_bytes']:,} B, "
        f"{ar16['ratio']:.1f}x fewer",
    ]
    print("\n".join(lines))
    measured = {r["compressor"]: r for r in rows if r["layout"] == "one flat buffer"}
    counted = measured[f"csc {args.density:g} fp16"]["wire_bytes"]
    if counted != ar16["wire_bytes"]:
        print(f"WARNING: counted {counted} B but the arithmetic gives "
              f"{ar16['wire_bytes']} B", file=sys.stderr)

    # --- whole-run average with DGC's warm-up (4 epochs) in a 90-epoch run ---------------------
    warm_cfg = CompressionConfig(method="csc", density=args.density, chunk_size=args.chunk_size)
    per_epoch = []
    for epoch in range(len(warm_cfg.warmup_densities) + 1):
        c = make_compressor(warm_cfg, 1)
        c.set_epoch(epoch)
        comps, _, _ = one_step(warm_cfg, [whole], 1, comps=[c])
        wire = comps[0].stats.as_dict()["average"]["wire_bytes"]
        per_epoch.append((epoch, comps[0].density_in_force(), wire))
        del comps, c
    epochs = 90
    steady_b = per_epoch[-1][2]
    warm_b = sum(b for _, _, b in per_epoch[:-1])
    run_avg = (warm_b + (epochs - len(per_epoch) + 1) * steady_b) / epochs
    print("Warm-up (density in force -> wire bytes per step): " +
          ", ".join(f"epoch {e}: {dn:g} -> {b:,.0f} B" for e, dn, b in per_epoch))
    print(f"Whole-run average over {epochs} epochs: {run_avg:,.0f} B/step "
          f"({4 * n / run_avg:.1f}x fewer); steady state {steady_b:,.0f} B/step "
          f"({4 * n / steady_b:.1f}x)")

    # --- time one compress+reduce of the whole gradient, 2 simulated ranks ------------------------
    timed = {
        "none": CompressionConfig(method="none"),
        "fp16": CompressionConfig(method="fp16"),
        "csc 10%": CompressionConfig(method="csc", density=0.1, **common),
        f"csc {args.density:g}": CompressionConfig(method="csc", density=args.density, **common),
        "csc 0.1%": CompressionConfig(method="csc", density=0.001, **common),
    }
    if args.quick:  # the runner's quick mode has a 3-minute budget on 2 shared cores
        timed = {k: v for k, v in timed.items() if k in ("none", "fp16", f"csc {args.density:g}")}
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen) for _ in range(world)]
    ranks = {label: [make_compressor(cfg, world) for _ in range(world)]
             for label, cfg in timed.items()}
    times: dict[str, list[float]] = {label: [] for label in timed}
    for label in timed:  # warm up: first-call compilation, residual allocation
        one_step(timed[label], [whole], world, grads=grads, comps=ranks[label])
    for _ in range(reps):
        for label in timed:
            _, dt, _ = one_step(timed[label], [whole], world, grads=grads, comps=ranks[label])
            times[label].append(dt)
    trows = [{"compressor": label, "median_ms": 1e3 * statistics.median(ts),
              "min_ms": 1e3 * min(ts),
              "per_rank_ms": 1e3 * statistics.median(ts) / world} for label, ts in times.items()]
    buckets_b = ddp_buckets(shapes)
    brows = step_budget(budget_configs(args.density, args.chunk_size), buckets_b,
                        reps if not args.quick else 2)
    threads = kernels.get_num_threads()

    t1 = ["compressor", "layout", "wire_bytes", "dense_fp32_bytes", "ratio", "chunks_sent"]
    t2 = ["compressor", "median_ms", "min_ms", "per_rank_ms"]
    from benchmarks.common import machine_line, markdown_table, write_result

    md = "\n".join([
        "## Compression: wire bytes and compress+reduce time (ResNet-50 gradient)", "",
        machine_line(), "",
        "Wire bytes per steady-state step (counted by the compressors' statistics; density "
        f"{args.density:g}, chunk {args.chunk_size}, FP32 norms; dense part = {d:,} elements of "
        f"tensors with dim <= 1 or numel < {cfg0.min_numel}):", "",
        markdown_table(t1, rows), "",
        "```", *lines, "```", "",
        f"Whole-run average with DGC's warm-up over {epochs} epochs: {run_avg:,.0f} B/step "
        f"({4 * n / run_avg:.1f}x fewer than dense FP32); steady state {steady_b:,.0f} B/step.", "",
        f"One compress+reduce of the {n:,}-element gradient, {world} ranks simulated in one "
        f"process (both ranks' work + the sums), median of {reps}; kernel threads {threads}:", "",
        markdown_table(t2, trows), "",
        "Per-step hook budget: one rank's compression work per ResNet-50 step as the DDP hook "
        f"runs it ({len(buckets_b)} buckets of {DDP_BUCKET_MB} MB, collectives replaced by the "
        f"identity), median of {reps if not args.quick else 2}, kernel threads {threads}; "
        "cpu = process CPU time (all threads), which other processes on the cores inflate less "
        "than wall time:", "",
        markdown_table(["compressor", "buckets", "wall_ms", "cpu_ms", "min_wall_ms"], brows),
    ])
    print(markdown_table(t1, rows))
    print(markdown_table(t2, trows))
    print(markdown_table(["compressor", "buckets", "wall_ms", "cpu_ms", "min_wall_ms"], brows))
    write_result(args.out, "compression", {
        "numel": n, "dense_numel": d, "one_d_numel": d1, "chunk_size": args.chunk_size,
        "density": args.density,
        "wire_rows": rows, "arithmetic_dense_fp32": ar32, "arithmetic_dense_fp16": ar16,
        "warmup_per_epoch": per_epoch, "whole_run_avg_bytes": run_avg, "time_rows": trows,
        "reps": reps,
        "kernel_threads": threads, "world": world, "budget_rows": brows,
    }, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
