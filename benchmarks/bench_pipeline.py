"""Compressed traffic through the engine: CSC's buckets fused and pipelined, against no
communication at all.

    python -m benchmarks.bench_pipeline --quick            # tiny model, loopback, seconds
    python -m benchmarks.bench_pipeline                    # ResNet-50 and AlexNet, 1 and 10 Gbps

Two ranks, each in its own network namespace behind a tbf-shaped veth (benchmarks/netem.py),
run in one launch, in interleaved rounds (bench_e2e's worker): the step with no communication
(the limit), DDP with a hook that sends nothing (DDP's own cost: its autograd hooks, bucket
copies and buffer broadcasts, on the gradientflow group), and CSC at 1% (the DDP hook unless
said) in these forms:

- unfused: every bucket its own op with its own two collectives (fusion threshold 0), the
  engine waiting on each;
- fused (the default): the buckets of a step in one op, two collectives per step, each bucket
  sending its own ceil(density x chunks);
- fused, fusion threshold 32 MB: a step cut into batches of about 32 MB of gradient, so the
  earlier batches travel while backward still runs;
- fused, pool selection: the top chunks chosen across the whole batch;
- the DistributedOptimizer (no DDP) with CSC 1%: its partitions in the same fused batches.

Every variant trains with SGD at momentum 0.9 (`--momentum`), as a user would: the limit's
optimizer runs its momentum pass, and so does CSC's default recipe (the hook is registered
with the optimizer, whose learning rate the residual follows); under momentum correction the
momentum would move into the compressor; either way each variant applies the momentum once.

Reported per variant: median step time, its speed as a fraction of the no-communication
speed (the issue's target: >= 0.90 at 1 Gbps, >= 0.85 at 10 Gbps), CPU ms per step over the
no-communication step, collectives per step, and where the engine's time goes (compressor time
on the engine thread, time its collectives were in flight, agreement rounds), per step.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run by path: make benchmarks.* importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import fmt, machine_line, markdown_table, results_dir, write_result

NAME = "pipeline"
VARIANTS = ("nocomm", "ddp_noop", "gf_csc1_unfused", "gf_csc1", "gf_csc1_t32", "gf_csc1_pool",
            "gf_opt_csc1")
TARGETS = {1.0: 0.90, 10.0: 0.85}  # fraction of the no-communication speed


def _rows(res, variants, model, tier, rate, shaped, batch):
    from benchmarks.bench_e2e import ENGINE_STATS, _summarise

    rows = _summarise(res, variants, 2, model, tier, shaped, batch)
    limit = next((r for r in rows if r["variant"] == "nocomm" and "median_ms" in r), None)
    for r in rows:
        r["rate_gbps"] = rate
        r["load1"] = os.getloadavg()[0]
        if "median_ms" not in r:
            continue
        if limit:
            r["of_limit"] = limit["median_ms"] / r["median_ms"]
            if r.get("extra_cpu_ms") is not None and r["variant"] != "nocomm":
                # The step's gap to the limit that is not this rank's CPU: waiting on the wire,
                # on the other rank, or on a thread hand-off.
                r["waiting_ms"] = max(r["comm_ms"] - r["extra_cpu_ms"], 0.0)
        eng = [x["engine"].get(r["variant"]) for x in res.results]
        if all(e for e in eng):
            for k in ENGINE_STATS:
                r[k] = sum(e[k] for e in eng) / len(eng)
            r["collectives"] = r["fused_operations"]
            r["codec_ms"] = r["codec_time_s"] * 1e3
            r["inflight_ms"] = r["comm_time_s"] * 1e3
            r["agree_ms"] = r["agreement_time_s"] * 1e3
        target = TARGETS.get(rate)
        if target is not None and r["variant"].startswith("gf_") and "of_limit" in r:
            r["target"] = target
            r["met"] = "yes" if r["of_limit"] >= target else "no"
    return rows


def merge_launches(launches: list[list[dict]]) -> list[dict]:
    """One row per variant from several launches of one model and tier: the median over the
    launches of every number, and each launch's speed kept (`of_limit_each`).

    A launch's speed is measured against the limit of the same launch, so the median speed is
    the median of those ratios, not a ratio of medians; the verdict follows from it.
    """
    by_variant: dict[str, list[dict]] = {}
    for rows in launches:
        for r in rows:
            by_variant.setdefault(r["variant"], []).append(r)
    out = []
    for rs in by_variant.values():
        merged = dict(rs[0])
        for key in rs[0]:
            vals = [r.get(key) for r in rs]
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
                merged[key] = statistics.median(vals)
        merged["launches"] = len(rs)
        if all("of_limit" in r for r in rs):
            merged["of_limit_each"] = ", ".join(fmt(r["of_limit"]) for r in rs)
        if merged.get("target") is not None and "of_limit" in merged:
            merged["met"] = "yes" if merged["of_limit"] >= merged["target"] else "no"
        out.append(merged)
    return out


def add_floor(rows) -> None:
    """Add to each CSC row the least step time this machine allows it, from the same launch.

    floor = DDP's own cost (the no-op hook's gap to the limit) + the error-feedback floor (the
    memory passes any compressor with a residual makes on the rank's one core: gradient into
    residual, buckets rewritten; under momentum correction the velocity's pass moves from the
    optimizer into the compressor, so it adds nothing net) + the wire time of the step's bytes at
    the probed link rate, unless it is hidden under backward. best = limit / (limit + floor).
    """
    for key in dict.fromkeys((r["model"], r["tier"]) for r in rows):
        sub = {r["variant"]: r for r in rows if (r["model"], r["tier"]) == key and "median_ms" in r}
        limit, noop = sub.get("nocomm"), sub.get("ddp_noop")
        if not limit or not noop:
            continue
        for r in sub.values():
            ef, rate = r.get("ef_floor_ms"), r.get("link_gbps") or r.get("rate_gbps")
            if not r["variant"].startswith("gf_") or not ef or not rate:
                continue
            r["wire_ms"] = r["wire_MB_per_step"] * 8.0 / rate
            hidden = noop["comm_ms"] + ef
            r["floor_ms"] = hidden + r["wire_ms"]
            r["best_of_limit"] = limit["median_ms"] / (limit["median_ms"] + r["floor_ms"])
            r["best_hidden_of_limit"] = limit["median_ms"] / (limit["median_ms"] + hidden)


def run(models, tiers, steps, rounds, warmup, timeout_s, loopback, bucket_view=False,
        log=print, momentum=0.9, broadcast_buffers=True, launches=1, variants=VARIANTS):
    import contextlib

    from benchmarks.bench_e2e import (MODELS, _available_bytes, _model_params, _split_for_memory,
                                      launch_worker)
    from benchmarks.netem import Cluster, ShapeConfig

    rows, notes = [], []
    for model in models:
        cfg = MODELS[model]
        common = {"model": model, "batch": cfg["batch"], "image": cfg["image"], "steps": steps,
                  "rounds": rounds, "warmup": warmup, "bucket_view": bucket_view,
                  "momentum": momentum, "broadcast_buffers": broadcast_buffers}
        for rate in tiers:
            shape = ShapeConfig(rate_gbps=rate)
            if loopback:
                cluster = Cluster(2, shape)
                cluster.tag, cluster.shaped, cluster.reason = "loopback", False, "requested"
                ctx = contextlib.nullcontext(cluster)
            else:
                ctx = Cluster(2, shape, allow_fallback=True)
            with ctx as cluster:
                if rate is not None and not cluster.shaped:
                    notes.append(f"{shape.label} not emulated ({cluster.reason}): skipped")
                    continue
                label = shape.label if cluster.shaped else "loopback"
                parts = _split_for_memory(list(variants), _model_params(model), 2,
                                          _available_bytes())
                for part in parts:
                    each = []
                    for i in range(launches):
                        t0 = time.monotonic()
                        res = launch_worker(2, common, part, cluster, timeout_s, notes,
                                            f"{model} {label} launch {i}", log)
                        if res is None:
                            continue
                        got = _rows(res, part, model, label, rate, cluster.shaped,
                                    cfg["batch"])
                        each.append(got)
                        log(f"[pipeline] {model} {label} launch {i} "
                            f"({time.monotonic() - t0:.0f} s): " +
                            ", ".join(f"{r['variant']} {fmt(r.get('median_ms'))} ms "
                                      f"({fmt(r.get('of_limit'))})" for r in got))
                    if each:
                        rows.extend(merge_launches(each))
    add_floor(rows)
    return rows, notes


def _markdown(rows, notes, cmd, machine=None) -> str:
    out = [f"## CSC through the engine: fused, pipelined, against no communication (`{NAME}`)",
           "", machine_line(machine), f"Command: `{cmd}`", "",
           "2 ranks, one thread each; every variant's optimizer is SGD with the same momentum "
           "(under CSC it moves into the compressor); median step time over interleaved rounds (a "
           "step ends when its slowest rank does). of limit = no-communication step time / step "
           "time (the speed kept). CPU over nocomm = the rank's process CPU per step minus the no-"
           "communication step's; waiting = the gap to the limit that is not CPU. Collectives = "
           "transport collectives per step; compressor = engine-thread time compressing and "
           "decompressing per step; in flight = time its collectives were in flight per step "
           "(overlaps the rest); agree = agreement rounds' time per step. Load avg: the machine's "
           "1-minute load after the launch (2 is this benchmark's own ranks). With several "
           "launches (`--launches`) every number is the median over the launches, and 'each "
           "launch' lists every launch's speed kept (each against its own limit).", "",
           "Floor (`add_floor`): the least step time over the limit this machine allows CSC, from "
           "the same launch (with several, from the medians over them): DDP's own cost (the "
           "no-op hook's gap) + the error-feedback floor (the memory passes any compressor with "
           "a residual makes on the rank's one core) + the step's wire bytes at the probed link "
           "rate. best = limit / (limit + floor); 'wire "
           "hidden' leaves the wire time out, as if every byte travelled under backward.", ""]
    for model in dict.fromkeys(r["model"] for r in rows):
        sub = [r for r in rows if r["model"] == model]
        out += [f"### {model}", "", markdown_table(
            ["tier", "label", "median_ms", "of_limit", "of_limit_each", "target", "met",
             "comm_ms", "extra_cpu_ms",
             "waiting_ms", "collectives", "codec_ms", "inflight_ms", "agree_ms",
             "wire_MB_per_step", "ef_floor_ms", "wire_ms", "floor_ms", "best_of_limit",
             "best_hidden_of_limit", "load1", "skipped"], sub,
            ["tier", "variant", "median ms", "of limit", "each launch", "target", "met",
             "gap to limit ms",
             "CPU ms over nocomm", "waiting ms", "collectives/step", "compressor ms/step",
             "in flight ms/step", "agree ms/step", "wire MB/step/rank", "EF floor ms",
             "wire ms", "floor ms", "best of limit", "best, wire hidden", "load avg",
             "note"]), ""]
    if notes:
        out += ["Notes:", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model on loopback: seconds")
    ap.add_argument("--out", default=results_dir(NAME))
    ap.add_argument("--models", default=None, help="comma list of resnet50,alexnet,tiny")
    ap.add_argument("--tiers", default=None, help="comma list of Gbit/s (default 1,10)")
    ap.add_argument("--steps", type=int, default=12, help="timed steps per variant")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--launches", type=int, default=1,
                    help="launches per model and tier (numbers: medians over them); the same "
                         "code read up to 0.05 apart from one launch to the next")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    ap.add_argument("--loopback", action="store_true", help="unshaped loopback, no namespaces")
    ap.add_argument("--bucket-view", action="store_true",
                    help="DDP's gradient_as_bucket_view (gradients live in the buckets: two "
                         "copies per step fewer)")
    ap.add_argument("--no-broadcast-buffers", action="store_true",
                    help="DDP without its broadcast of rank 0's BN statistics before each "
                         "forward, for every DDP variant (Horovod broadcasts them once); the "
                         "limit never sends them")
    ap.add_argument("--momentum", type=float, default=0.9,
                    help="every variant's SGD momentum (0: plain SGD; CSC then runs plain "
                         "error feedback)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma list, the limit first (also: gf_opt_csc1_nf, the "
                         "DistributedOptimizer with CSC 1%% and next-forward overlap)")
    ap.add_argument("--table-only", action="store_true",
                    help="rebuild the markdown (floor columns included) from OUT/pipeline.json "
                         "of the latest run; runs nothing")
    args = ap.parse_args(argv)
    from benchmarks.bench_e2e import LABELS

    variants = tuple(args.variants.split(","))
    if variants[0] != "nocomm" or any(v not in LABELS for v in variants):
        ap.error(f"--variants {args.variants!r}: a comma list of {sorted(LABELS)}, "
                 "nocomm first (the limit every other variant is measured against)")
    if args.table_only:
        import json
        import re

        out = Path(args.out)
        data = json.loads((out / f"{NAME}.json").read_text())
        if not data.get("command"):  # written before the command was kept in the JSON
            m = re.search(r"^Command: `(.*)`$", (out / f"{NAME}.md").read_text(), re.M)
            data["command"] = m.group(1) if m else "unknown"
        add_floor(data["rows"])
        md = _markdown(data["rows"], data["notes"], data["command"], data.get("machine"))
        print(md)
        write_result(out, NAME, {k: v for k, v in data.items() if k != "name"}, md)
        return 0
    if args.quick:
        models, tiers, loopback = ["tiny"], [None], True
        args.steps, args.rounds, args.warmup = 4, 2, 1
    else:
        models = (args.models or "resnet50,alexnet").split(",")
        tiers = [float(t) for t in (args.tiers or "1,10").split(",")]
        loopback = args.loopback
        if loopback:
            tiers = [None]
    rows, notes = run(models, tiers, args.steps, args.rounds, args.warmup, args.timeout,
                      loopback, args.bucket_view, momentum=args.momentum,
                      broadcast_buffers=not args.no_broadcast_buffers,
                      launches=args.launches, variants=variants)
    cmd = "python -m benchmarks.bench_pipeline " + " ".join(argv if argv is not None
                                                           else sys.argv[1:])
    md = _markdown(rows, notes, cmd)
    print(md)
    write_result(args.out, NAME, {"rows": rows, "notes": notes, "command": cmd}, md)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
