"""Where a compressed step's time goes: each thread's CPU, and the critical path after backward.

Two ranks on the emulated link run the no-communication step and one gradientflow variant (CSC
1% fused, by default) as bench_pipeline runs them (bench_e2e's worker), with the engine's
timeline on. Printed for rank 0:

- CPU per step of each of its threads (main: forward, backward and the optimizer; engine: the
  compressor's passes, the rounds and the stages; reaper: unpacks; gloo's threads), read from
  /proc around the timed steps, and what is left of the step: the time no thread of the rank
  ran (waiting for the wire, for the other rank or for a hand-off);
- the tail: from the agreement round that closes a step's last batch to the end of its final
  unpack, each phase's median start, end and duration (round, stage 1, selection and packing,
  stage 2, unpack), from the timeline. The tail is what backward does not hide.

    python -m benchmarks.step_anatomy --model resnet50 --tier 1 --bucket-view --no-broadcast-buffers
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run by path: make benchmarks.* importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import fmt, machine_line, markdown_table, results_dir, write_result

NAME = "step_anatomy"


def tail_phases(events: list[dict]) -> list[dict]:
    """Per step, the engine's phases from the step's last agreement round to its last event.

    `events`: a rank's timeline (complete events, and the "step N" instants that
    `gradientflow.mark_step` records). Returns one row per phase position: its name, the median
    start and end after the round began and the median duration, over the steps that have a
    round (medians of each, so start + duration need not equal the end).
    """
    marks = sorted(e["ts"] for e in events if e.get("ph") == "i" and e.get("name", "")
                   .startswith("step "))
    spans = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") != "step"),
                   key=lambda e: e["ts"])
    per_position: dict[int, list[tuple[str, float, float]]] = {}
    for lo, hi in zip(marks, marks[1:]):
        inside = [e for e in spans if lo <= e["ts"] < hi]
        rounds = [i for i, e in enumerate(inside) if e["name"] == "agree"]
        if not rounds:
            continue
        tail = inside[rounds[-1]:]
        t0 = tail[0]["ts"]
        for pos, e in enumerate(tail):
            per_position.setdefault(pos, []).append((e["name"], e["ts"] - t0, e["dur"]))
    rows = []
    for pos in sorted(per_position):
        got = per_position[pos]
        names = {n for n, _, _ in got}
        rows.append({"phase": "/".join(sorted(names)), "steps": len(got),
                     "start_ms": statistics.median(s for _, s, _ in got) / 1e3,
                     "end_ms": statistics.median(s + d for _, s, d in got) / 1e3,
                     "dur_ms": statistics.median(d for _, _, d in got) / 1e3})
    if rows:
        last = rows[-1]
        rows.append({"phase": "tail (round to last unpack)", "steps": last["steps"],
                     "start_ms": 0.0, "end_ms": last["end_ms"], "dur_ms": last["end_ms"]})
    return rows


def _thread_rows(res, variants) -> list[dict]:
    """Rank 0's CPU ms per step by thread, per variant, and the step's time no thread ran."""
    r0 = res.results[0]
    rows = []
    for v in variants:
        cpu = r0.get("thread_cpu_ms", {}).get(v)
        times = r0["times"].get(v)
        if not cpu or not times:
            continue
        step_ms = 1e3 * statistics.median(times)
        for name, ms in sorted(cpu.items(), key=lambda kv: -kv[1]):
            if ms >= 0.05:
                rows.append({"variant": v, "thread": name, "cpu_ms": ms})
        rows.append({"variant": v, "thread": "(no thread ran: waiting)",
                     "cpu_ms": max(step_ms - sum(cpu.values()), 0.0)})
        rows.append({"variant": v, "thread": "(median step)", "cpu_ms": step_ms})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--tier", type=float, default=1.0, help="Gbit/s of the emulated link")
    ap.add_argument("--variant", default="gf_csc1", help="a bench_e2e gradientflow variant")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--bucket-view", action="store_true")
    ap.add_argument("--no-broadcast-buffers", action="store_true")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--out", default=results_dir(NAME))
    args = ap.parse_args(argv)

    from benchmarks.bench_e2e import MODELS, launch_worker
    from benchmarks.netem import Cluster, ShapeConfig
    from gradientflow.observability.timeline import load_trace

    cfg = MODELS[args.model]
    variants = ["nocomm", args.variant]
    with tempfile.TemporaryDirectory(prefix="gf-anatomy-") as tmp, \
            Cluster(2, ShapeConfig(rate_gbps=args.tier)) as cluster:
        if not cluster.shaped:
            print(f"step_anatomy: {args.tier:g} Gbit/s not emulated ({cluster.reason})")
            return 1
        notes: list[str] = []
        res = launch_worker(
            2, {"model": args.model, "batch": cfg["batch"], "image": cfg["image"],
                "steps": args.steps, "rounds": args.rounds, "warmup": 3,
                "bucket_view": args.bucket_view, "momentum": args.momentum,
                "broadcast_buffers": not args.no_broadcast_buffers, "mark_steps": True},
            variants, cluster, 900, notes, "step_anatomy's launch",
            env_extra={"GRADIENTFLOW_TIMELINE": str(Path(tmp) / "rank{rank}.json")})
        if res is None:
            return 1
        tail = tail_phases(load_trace(str(Path(tmp) / "rank0.json"))["traceEvents"])
    threads = _thread_rows(res, variants)
    cmd = "python -m benchmarks.step_anatomy " + " ".join(argv if argv is not None
                                                         else sys.argv[1:])
    md = "\n".join([
        f"## Where a compressed step's time goes (`{NAME}`)", "", machine_line(),
        f"Command: `{cmd}`", "",
        f"{args.model}, 2 ranks, {args.tier:g} Gbit/s emulated; rank 0. CPU ms per step of each "
        "thread over the timed steps (/proc, 10 ms ticks), and the step's time in which no "
        "thread of the rank ran.", "",
        markdown_table(["variant", "thread", "cpu_ms"], threads,
                       ["variant", "thread", "ms per step"]), "",
        f"The tail of {args.variant}'s steps on the engine's timeline: from the round that "
        "closes the step's last batch, each phase's median start, end and duration (stage 1's "
        "allreduce carries the chunk norms and the FP32 dense part; 'decompress' after it is "
        "selection and packing; stage 2 carries the packed chunks; the last 'decompress' is the "
        "unpack).", "",
        markdown_table(["phase", "steps", "start_ms", "end_ms", "dur_ms"], tail,
                       ["phase", "steps", "start ms after the round", "end ms", "ms"]), ""])
    print(md)
    write_result(args.out, NAME, {"command": cmd, "threads": threads, "tail": tail,
                                  "median_step_ms": {v: fmt(1e3 * statistics.median(t))
                                                     for v, t in res.results[0]["times"]
                                                     .items()}}, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
