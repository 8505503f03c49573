"""Measure the timeline's overhead: recording on, recording off, and no calls at all.

A step records `--events` phases (200 by default: about one per tensor of a ResNet-50 step),
either as context-manager spans or as `complete()` calls made after the fact (how the engine
records per-bucket phases). All modes run side by side in each repeat; medians over repeats.

* ``none``: the same loop with no timeline call (the baseline subtracted from the others);
* ``off``: calls into a recorder that is not recording (one attribute read each);
* ``on``: recording; "critical path" is the calling thread's wall time, "total" the process's
  CPU time (all threads) including the background writer's JSON encoding and file writes
  (through stop(), which drains): what a training step can lose to the timeline when the
  writer contends for the GIL or a core.

Run: ``python benchmarks/bench_timeline.py [--quick] [--out DIR]``
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gradientflow.observability import timeline as T

STEP_MS = 200.0   # the step time the overhead is expressed against (a ResNet-50 step, order of)


def _loop_none(tl, n):
    t0 = time.perf_counter_ns()
    for _ in range(n):
        pass
    return time.perf_counter_ns() - t0


def _loop_span(tl, n):
    span, cat = tl.span, T.CAT_CODEC
    t0 = time.perf_counter_ns()
    for _ in range(n):
        with span("compress", cat, tid="bucket 0"):
            pass
    return time.perf_counter_ns() - t0


def _loop_guarded(tl, n):
    # How a hot engine path can skip even the call: test the flag inline.
    complete, cat, now = tl.complete, T.CAT_COMM, T.now_us
    t0 = time.perf_counter_ns()
    for _ in range(n):
        if tl.enabled:
            complete("allreduce", cat, now(), 12.5, "bucket 0", None)
    return time.perf_counter_ns() - t0


def _loop_complete(tl, n):
    complete, cat, now = tl.complete, T.CAT_COMM, T.now_us
    args = {"bucket": 0, "bytes": 1 << 20}
    t0 = time.perf_counter_ns()
    for _ in range(n):
        complete("allreduce", cat, now(), 12.5, "bucket 0", args)
    return time.perf_counter_ns() - t0


def _steps(tl, loop, n_events, n_steps):
    """Time `n_steps` steps of `n_events` calls; return per-step nanoseconds (list)."""
    out = []
    for step in range(n_steps):
        tl.mark_step(step)
        out.append(loop(tl, n_events))
    return out


def measure(n_events: int, n_steps: int, repeats: int, workdir: str) -> dict:
    """Return medians of per-step time (us) for every mode, measured side by side per repeat."""
    kinds = {"span": _loop_span, "complete": _loop_complete}
    samples = {k: [] for k in ("none", "off_guard", "off_span", "off_complete", "on_span",
                               "on_complete", "total_span", "total_complete")}
    file_bytes = {}
    for r in range(repeats):
        off = T.Timeline()
        samples["none"] += _steps(off, _loop_none, n_events, n_steps)
        samples["off_guard"] += _steps(off, _loop_guarded, n_events, n_steps)
        for kind, loop in kinds.items():
            samples[f"off_{kind}"] += _steps(off, loop, n_events, n_steps)
            tl = T.Timeline()
            path = tl.start(os.path.join(workdir, f"{kind}{r}.json"), rank=0)
            # "total" is the process's CPU time (all threads): recording plus the writer's
            # encoding and writing, without the wall-clock noise of other processes on the host.
            c0 = time.process_time_ns()
            per_step = _steps(tl, loop, n_events, n_steps)
            tl.stop()  # drains the writer: its encoding and writing are counted in "total"
            total = time.process_time_ns() - c0
            samples[f"on_{kind}"] += per_step
            samples[f"total_{kind}"].append(total / n_steps)
            file_bytes[kind] = os.path.getsize(path)
            os.remove(path)
    med = {k: statistics.median(v) / 1000.0 for k, v in samples.items()}  # us per step
    base = med["none"]
    rows = []
    for mode, label in (("off_guard", "off: `if TIMELINE.enabled:` guard"),
                        ("off_span", "off: span()"), ("off_complete", "off: complete()"),
                        ("on_span", "on: span(), critical path"),
                        ("on_complete", "on: complete(), critical path"),
                        ("total_span", "on: span(), total CPU incl. writer"),
                        ("total_complete", "on: complete(), total CPU incl. writer")):
        extra = max(0.0, med[mode] - base)
        rows.append({"mode": label, "us_per_step": med[mode], "us_per_event": extra / n_events,
                     "pct_of_step": 100.0 * extra / (STEP_MS * 1000.0)})
    events_per_file = n_steps * (n_events + 2)  # + the step marker and the step bar
    return {"events_per_step": n_events, "steps": n_steps, "repeats": repeats,
            "baseline_us_per_step": base, "step_ms": STEP_MS, "rows": rows,
            "file_bytes_per_event": {k: v / events_per_file for k, v in file_bytes.items()},
            "python": sys.version.split()[0], "cpus": os.cpu_count(),
            "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def to_markdown(res: dict, command: str) -> str:
    """Render the result as a markdown section."""
    lines = ["## Timeline overhead", "",
             f"`{command}`: {res['events_per_step']} events per step, {res['steps']} steps x "
             f"{res['repeats']} repeats, medians; baseline loop "
             f"{res['baseline_us_per_step']:.1f} us "
             f"per step; percent of a {res['step_ms']:.0f} ms step; {res['cpus']} CPUs, load "
             f"average {res['load_average_1min']:.1f} at the end.", "",
             "| mode | us per step | us per event (over no calls) | % of step |",
             "|---|---:|---:|---:|"]
    for r in res["rows"]:
        lines.append(f"| {r['mode']} | {r['us_per_step']:.1f} | {r['us_per_event']:.3f} | "
                     f"{r['pct_of_step']:.3f} |")
    fb = res["file_bytes_per_event"]
    lines += ["", f"File size: {fb.get('span', 0):.0f} bytes per span event, "
                  f"{fb.get('complete', 0):.0f} per complete() event with two args.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and repeats (seconds)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "timeline"),
                   help="directory for timeline.json and timeline.md")
    p.add_argument("--events", type=int, default=200, help="events per step (default 200)")
    a = p.parse_args(argv)
    n_steps, repeats = (20, 5) if a.quick else (50, 15)
    with tempfile.TemporaryDirectory() as work:
        res = measure(a.events, n_steps, repeats, work)
    command = "python benchmarks/bench_timeline.py" + (" --quick" if a.quick else "")
    md = to_markdown(res, command)
    print(md)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "timeline.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    with open(os.path.join(a.out, "timeline.md"), "w") as fh:
        fh.write(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
