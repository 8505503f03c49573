"""Lazy allreduce on real models' gradient lists: per-tensor gloo vs fused vs DDP-style buckets.

Each rank allreduces a model's gradient list asynchronously, one call per tensor in backward
order, then waits for all of them:
  - gloo per-tensor: the same calls on a plain gloo group (what fusion saves);
  - gloo 25 MB buckets: DDP's bucketing by hand, each bucket flattened and launched as soon as
    it is full, so the copy of bucket i+1 overlaps the transport of bucket i;
  - gloo hand-fused: the messages the default configuration cuts (Config's fusion and solo
    thresholds), sent by hand on gloo with no agreement round and no per-tensor call, the solo
    tensors on a second gloo group as the solo channel sends them (a bound: the default engine
    with zero overhead);
  - plugin floor: those messages behind the same per-tensor calls into a Python backend that
    does nothing else (fused_floor.py; its solos leave at their call): the bound plus what
    torch's dispatch into any Python backend costs per call, the floor for a backend written
    in Python;
  - gradientflow fused: the same per-tensor calls on gradientflow groups, at each fusion
    threshold of the sweep, plus solo thresholds and cycle times at the largest threshold
    (the table's best is over all of them: the settings a tuned job would use),
    "gf default": a group made with no options at all, what a one-line adopter gets, and
    "gf default, solo channel off": the same with its solo tensors kept in their batch's
    round (Config.solo_channel; what CUDA tensors do), to show what the channel is worth.
All variants are timed alternately, rep by rep, in one run. On loopback for every model, and
on the emulated switched network of benchmarks/netem.py (one namespace per rank, tbf both
ways) for the models and tiers of --net-models/--tiers, where the wire, not the copies, is the
limit.

    python benchmarks/bench_fusion.py [--quick] [--out DIR] [--tiers none,10,1]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (
    machine_line,
    markdown_table,
    median,
    paired_ratio,
    results_dir,
    write_result,
)
from benchmarks import fused_floor
from benchmarks.launch import launch
from benchmarks.netem import Cluster, ShapeConfig

MB = 10**6
DEFAULT = "gf default"  # the variant made with no options: Config's defaults
NO_CHANNEL = "gf default, solo channel off"
FLOOR = fused_floor.NAME
PLUGIN = "plugin floor"  # the hand-fused messages behind per-tensor calls (fused_floor.py)


def gradient_shapes(model: str) -> list[tuple[int, ...]]:
    """The parameter shapes of a model, in registration order."""
    if model == "bert-base":
        h, ff, layers, vocab = 768, 3072, 12, 30522
        shapes = [(vocab, h), (512, h), (2, h), (h,), (h,)]
        for _ in range(layers):
            shapes += [(h, h), (h,)] * 4 + [(h,), (h,), (ff, h), (ff,), (h, ff), (h,), (h,), (h,)]
        return shapes + [(h, h), (h,)]
    if model == "tiny":
        return [(64, 64), (64,), (128, 64), (128,), (10, 128), (10,)] * 4
    import torchvision

    net = getattr(torchvision.models, model)()
    return [tuple(p.shape) for p in net.parameters()]


def _variant_name(threshold: int, solo: int, cycle_ms: float | None = None) -> str:
    return (f"gf fused {threshold // MB}MB" + (f" solo {solo // MB}MB" if solo else "")
            + (f" cycle {cycle_ms:g}ms" if cycle_ms is not None else ""))


def worker(rank: int, world_size: int, models: list[str], thresholds: list[int],
           reps: int, solos: list[int] | None = None, cycles: list[float] | None = None) -> dict:
    """Time every variant on every model, alternating variants rep by rep (order rotated).

    solos: solo thresholds tried at the largest fusion threshold of the sweep (tensors at
    least this big go alone, in place; see Config.solo_threshold). cycles: cycle times (ms)
    tried with each of those solo variants besides the default (Config.cycle_time_ms): how
    long a partial batch waits for a quiet caller, which sets how many rounds a list takes.
    """
    import time

    import torch
    import torch.distributed as dist

    from gradientflow.backend.registry import backend_of
    from gradientflow.engine.fusion import FusableOp, pack, plan_messages, unpack

    torch.set_num_threads(1)
    gloo = dist.group.WORLD
    top = max(thresholds)
    configs = ([(t, 0, None) for t in thresholds] + [(top, s, None) for s in solos or []]
               + [(top, s, c) for s in solos or [] for c in cycles or []])
    gf = {_variant_name(t, s, c): dist.new_group(
        backend="gradientflow",
        pg_options={"fusion_threshold": t, "solo_threshold": s,
                    **({"cycle_time_ms": c} if c is not None else {})})
        for t, s, c in configs}
    gf[DEFAULT] = dist.new_group(backend="gradientflow")
    gf[NO_CHANNEL] = dist.new_group(backend="gradientflow", pg_options={"solo_channel": False})
    cfg = backend_of(gf[DEFAULT]).config  # what the default group cuts (hand_fused below)
    # hand_fused's solo channel, as the default sends it: a bound that sent its solos on
    # `gloo` too would be slower than the engine, and no bound.
    solo_gloo = dist.new_group(backend="gloo") if cfg.solo_channel else gloo
    # The plugin floor: the same messages behind per-tensor calls into a Python backend that
    # does nothing else (fused_floor.py): what the per-call dispatch alone costs.
    dist.Backend.register_backend(FLOOR, fused_floor.creator(
        gloo, solo_gloo, cfg.fusion_threshold, cfg.solo_threshold), devices=["cpu"])
    floor = dist.new_group(backend=FLOOR)
    out: dict = {}
    for model in models:
        grads = [torch.randn(s) for s in gradient_shapes(model)][::-1]  # backward order
        numel = sum(g.numel() for g in grads)

        def per_tensor(group, grads=grads):
            works = [dist.all_reduce(g, group=group, async_op=True) for g in grads]
            for w in works:
                w.wait()

        buckets, cur, size = [], [], 0
        for g in grads:
            cur.append(g)
            size += g.numel() * 4
            if size >= 25 * MB:
                buckets.append(cur)
                cur, size = [], 0
        if cur:
            buckets.append(cur)
        flats = [torch.empty(sum(g.numel() for g in b)) for b in buckets]

        def ddp_buckets(buckets=buckets, flats=flats):
            works = []
            for b, flat in zip(buckets, flats):
                torch.cat([g.reshape(-1) for g in b], out=flat)
                works.append(dist.all_reduce(flat, group=gloo, async_op=True))
            for b, flat, w in zip(buckets, flats, works):
                w.wait()
                off = 0
                for g in b:
                    g.copy_(flat[off:off + g.numel()].view_as(g))
                    off += g.numel()

        # The default configuration's own cut, sent by hand on gloo: every message launched at
        # once, no agreement round, no per-tensor calls. What a zero-overhead engine with the
        # same messages would take; the gap to "gf default" is the engine's cost (rounds,
        # per-call Python, thread hand-offs), not its choice of messages.
        plan = plan_messages([FusableOp(i, g, ("cpu", g.dtype, 0), None, None)
                              for i, g in enumerate(grads)], cfg.fusion_threshold,
                             cfg.solo_threshold)
        packed = [(m, torch.empty(m.numel)) for m in plan if not m.solo]

        def hand_fused(plan=plan, packed=packed):
            works = []
            for m in plan:
                if m.solo:
                    works.append(dist.all_reduce(m.ops[0].tensor, group=solo_gloo,
                                                 async_op=True))
            for m, flat in packed:
                pack(m.ops, flat)
                works.append(dist.all_reduce(flat, group=gloo, async_op=True))
            for w in works:
                w.wait()
            for m, flat in packed:
                unpack(flat, m.ops)

        variants = {"gloo per-tensor": lambda: per_tensor(gloo), "gloo 25MB buckets": ddp_buckets,
                    "gloo hand-fused": hand_fused, PLUGIN: lambda: per_tensor(floor)}
        for name, g in gf.items():
            variants[name] = lambda g=g: per_tensor(g)
        engines = {name: backend_of(g).engine for name, g in gf.items()}
        times = {k: [] for k in variants}
        rounds = {k: [] for k in engines}  # (rounds, round ms, messages) per list
        order = list(variants.items())
        for i in range(reps + 1):
            # Rotated rep by rep, so that no variant always runs right after the same one (what
            # a variant leaves behind, a reaper or pool still finishing, a cold cache, would
            # otherwise bias its successor's times the same way in every rep).
            k = i % len(order)
            for name, fn in order[k:] + order[:k]:
                eng = engines.get(name)
                c0 = ((eng.stats.rounds, eng.stats.round_s, eng.stats.messages)
                      if eng else None)
                dist.barrier(group=gloo)
                t0 = time.perf_counter()
                fn()
                if i:
                    times[name].append(time.perf_counter() - t0)
                    if eng is not None:
                        c = eng.stats
                        rounds[name].append((c.rounds - c0[0], (c.round_s - c0[1]) * 1e3,
                                             c.messages - c0[2]))
        out[model] = {"tensors": len(grads), "numel": numel,
                      "ms": {k: median(v) * 1e3 for k, v in times.items()},
                      # Per rep, in rep order: rep i of every variant ran within one rotation,
                      # so the i-th times pair up (paired_ratio).
                      "reps_ms": {k: [x * 1e3 for x in v] for k, v in times.items()},
                      # The agreement's cost: rounds per list and their time (waiting for the
                      # slower rank included), medians over reps.
                      "rounds": {k: [median([r[j] for r in v]) for j in range(3)]
                                 for k, v in rounds.items()}}
    return out


def _tier_label(rate: float | None) -> str:
    return "loopback" if rate is None else f"{rate:g} Gbps"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=results_dir("fusion"))
    ap.add_argument("--worlds", default=None, help="rank counts, e.g. 2,4")
    ap.add_argument("--models", default=None, help="models on loopback, e.g. resnet50,alexnet")
    ap.add_argument("--tiers", default=None,
                    help="emulated link rates in Gbit/s besides loopback ('none'), e.g. none,10,1")
    ap.add_argument("--net-models", default="resnet50",
                    help="models run on the emulated tiers (each rep moves the whole list)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--launches", type=int, default=1,
                    help="launches per tier and rank count; each variant's time is the median "
                         "over launches of its per-launch median (this machine's noise is "
                         "mostly between launches: the same A/B read 0.86x-1.01x)")
    ap.add_argument("--thresholds", default=None, help="fusion thresholds in MB, e.g. 16,64")
    ap.add_argument("--solos", default=None,
                    help="solo thresholds in MB tried at the largest fusion threshold, e.g. 2,8 "
                         "('' for none)")
    ap.add_argument("--cycles", default=None,
                    help="cycle times in ms tried with each solo variant, e.g. 3 ('' for none)")
    args = ap.parse_args(argv)
    if args.quick:
        models, thresholds, worlds, reps, tiers = ["tiny"], [1 * MB, 16 * MB], [2], 3, [None]
        solos, cycles = [1 * MB], [1.0]
    else:
        models = ["resnet50", "alexnet", "bert-base"]
        thresholds = [1 * MB, 4 * MB, 16 * MB, 64 * MB, 128 * MB]
        worlds, reps, tiers = [2, 4], 7, [None, 10.0]
        solos = [2 * MB, 8 * MB]
        # Horovod's 1 ms besides the default 3 ms (Config.cycle_time_ms says why).
        cycles = [1.0]
    if args.thresholds:
        thresholds = [int(float(t) * MB) for t in args.thresholds.split(",")]
    if args.solos is not None:
        solos = [int(float(t) * MB) for t in args.solos.split(",") if t.strip()]
    if args.cycles is not None:
        cycles = [float(c) for c in args.cycles.split(",") if c.strip()]
    if args.worlds:
        worlds = [int(w) for w in args.worlds.split(",")]
    if args.models:
        models = args.models.split(",")
    if args.tiers:
        tiers = [None if t.strip().lower() in ("none", "loopback", "") else float(t)
                 for t in args.tiers.split(",")]
    reps = args.reps or reps
    rows, raw, notes = [], {}, []
    for rate in tiers:
        tier_models = models if rate is None else args.net_models.split(",")
        for n in worlds:
            ctx = (contextlib.nullcontext(None) if rate is None
                   else Cluster(n, ShapeConfig(rate_gbps=rate)))
            with ctx as cluster:
                if rate is not None and not cluster.shaped:
                    notes.append(f"{_tier_label(rate)} not emulated ({cluster.reason}): skipped")
                    continue
                runs = []
                for _ in range(max(1, args.launches)):
                    res = launch("benchmarks.bench_fusion:worker", world_size=n,
                                 kwargs={"models": tier_models, "thresholds": thresholds,
                                         "reps": reps, "solos": solos, "cycles": cycles},
                                 cluster=cluster, timeout_s=3000)
                    if not res.ok:
                        print(res.error)
                        return 1
                    runs.append(res.results[0])
            merged = _merge_launches(runs)
            raw[f"{_tier_label(rate)} {n}"] = runs if len(runs) > 1 else runs[0]
            for model, r in merged.items():
                rows.append(_row(_tier_label(rate), n, model, r))
    cols = list(rows[0].keys()) if rows else []
    md = (f"## Lazy allreduce: fused vs per-tensor vs 25 MB buckets (median ms for the whole "
          f"gradient list)\n\n{machine_line()}\n\nRatios > 1 mean gradientflow is faster. "
          "Emulated tiers: one network namespace per rank behind a bridge, each NIC shaped "
          "with tbf in both directions (benchmarks/netem.py). The paired columns take the "
          "median of each rep's own ratio (the variants of a rep run back to back) over the "
          "reps of every launch, with its 95% interval (a bootstrap over launches, then reps; "
          "benchmarks/common.py, paired_ratio): an interval that holds 1 means no difference "
          "this run could resolve. The best fused variant is picked by its time, so its "
          "interval leans high; the default's does not."
          + (f" Every time is the median over {args.launches} launches of each launch's "
             f"median of {reps} reps." if args.launches > 1 else "") + "\n\n"
          + markdown_table(cols, rows) + "".join(f"\n- {n}" for n in notes))
    print(md)
    write_result(args.out, "fusion", {"rows": rows, "raw": raw, "notes": notes}, md)
    return 0


def _merge_launches(runs: list[dict]) -> dict:
    """Rank 0's results of several launches as one: medians over launches, per variant; the
    per-rep times as one list per launch (a pair never spans two launches)."""
    out = {}
    for model, first in runs[0].items():
        per = [r[model] for r in runs]
        out[model] = {
            "tensors": first["tensors"], "numel": first["numel"],
            "ms": {k: median([p["ms"][k] for p in per]) for k in first["ms"]},
            "reps_ms": {k: [p["reps_ms"][k] for p in per] for k in first["ms"]},
            "rounds": {k: [median([p["rounds"][k][j] for p in per]) for j in range(3)]
                       for k in first["rounds"]}}
    return out


def _row(tier: str, n: int, model: str, r: dict) -> dict:
    """One table row: the baselines, the best threshold and every threshold of the sweep."""
    ms = r["ms"]
    fused = {k: v for k, v in ms.items() if k.startswith("gf fused")}
    best = min(fused, key=fused.get)
    n_rounds, round_ms, messages = r["rounds"][best]
    reps = r["reps_ms"]

    def paired(name: str) -> str:
        mid, lo, hi = paired_ratio(reps["gloo 25MB buckets"], reps[name])
        return f"{mid:.3f} [{lo:.3f}, {hi:.3f}]"

    return {"tier": tier, "ranks": n, "model": model, "tensors": r["tensors"],
            "MB": r["numel"] * 4 / MB, "gloo per-tensor ms": ms["gloo per-tensor"],
            "gloo 25MB buckets ms": ms["gloo 25MB buckets"],
            "best fused": best.replace("gf fused ", ""), "fused ms": fused[best],
            "per-tensor / fused": ms["gloo per-tensor"] / fused[best],
            "buckets / fused": ms["gloo 25MB buckets"] / fused[best],
            "gloo hand-fused ms": ms["gloo hand-fused"],
            "buckets / hand-fused": ms["gloo 25MB buckets"] / ms["gloo hand-fused"],
            "plugin floor ms": ms[PLUGIN],
            "buckets / plugin floor": ms["gloo 25MB buckets"] / ms[PLUGIN],
            "rounds": n_rounds, "round ms": round_ms, "messages": messages,
            "default ms": ms[DEFAULT], "buckets / default": ms["gloo 25MB buckets"] / ms[DEFAULT],
            "paired buckets / best fused (95% CI)": paired(best),
            "paired buckets / default (95% CI)": paired(DEFAULT),
            "paired buckets / default, solo channel off (95% CI)": paired(NO_CHANNEL),
            "paired buckets / hand-fused (95% CI)": paired("gloo hand-fused"),
            "paired buckets / plugin floor (95% CI)": paired(PLUGIN),
            **{k.replace("gf fused ", "gf "): v for k, v in fused.items()}}


if __name__ == "__main__":
    sys.exit(main())
