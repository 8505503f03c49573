"""Summarise a GradientFlow timeline: top phases, per-step communication time, a plot of one step.

Usage::

    python -m gradientflow.observability.summarize trace.rank0.json
    python -m gradientflow.observability.summarize merged.json --plot step.png --step 12

Leaf module: stdlib plus its sibling timeline.py; matplotlib is imported only to plot.
Communication time is the wall time covered by events whose category is in
`timeline.COMM_CATEGORIES` (transport collectives and agreement rounds), as a union of
intervals: phases of different buckets that overlap in time are not counted twice.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from typing import Iterable

from gradientflow.observability.timeline import (
    AGREE, ALLREDUCE, CAT_STEP, COMM_CATEGORIES, COMPRESS, DECOMPRESS, FUSE, QUEUE, STEP, UNPACK,
    load_trace,
)

# Legend and colour order: the pipeline's order, then anything else alphabetically.
_PIPELINE = (QUEUE, AGREE, FUSE, COMPRESS, ALLREDUCE, DECOMPRESS, UNPACK)

__all__ = ["intervals", "phase_totals", "step_windows", "per_step_comm", "summarize",
           "format_summary", "plot_step", "main"]


def intervals(events: Iterable[dict]) -> list[dict]:
    """Return every duration event as {pid, tid, name, cat, ts, dur, args}: X events and
    matched B/E pairs."""
    out, stacks = [], collections.defaultdict(list)
    for ev in sorted((e for e in events if e.get("ph") in ("X", "B", "E")),
                     key=lambda e: (e.get("ts", 0.0), 0 if e.get("ph") == "E" else 1)):
        ph = ev["ph"]
        key = (ev.get("pid", 0), ev.get("tid", 0))
        if ph == "X":
            out.append({"pid": key[0], "tid": key[1], "name": ev.get("name", ""),
                        "cat": ev.get("cat", ""), "ts": float(ev["ts"]),
                        "dur": float(ev.get("dur", 0.0)), "args": ev.get("args") or {}})
        elif ph == "B":
            stacks[key].append(ev)
        elif stacks[key]:  # an E closes the innermost B on its lane; unmatched Es are ignored
            b = stacks[key].pop()
            out.append({"pid": key[0], "tid": key[1], "name": b.get("name", ""),
                        "cat": b.get("cat", ""), "ts": float(b["ts"]),
                        "dur": float(ev["ts"]) - float(b["ts"]), "args": b.get("args") or {}})
    out.sort(key=lambda i: i["ts"])
    return out


def _phases(ivs: list[dict]) -> list[dict]:
    return [i for i in ivs if i["cat"] != CAT_STEP]


def phase_totals(ivs: list[dict]) -> list[dict]:
    """Return per (name, cat): count, total/mean/max in ms, sorted by total time, largest first."""
    acc: dict[tuple, list] = {}
    for i in _phases(ivs):
        a = acc.setdefault((i["name"], i["cat"]), [0, 0.0, 0.0])
        a[0] += 1
        a[1] += i["dur"]
        a[2] = max(a[2], i["dur"])
    rows = [{"name": n, "cat": c, "count": k, "total_ms": t / 1e3, "mean_ms": t / k / 1e3,
             "max_ms": m / 1e3} for (n, c), (k, t, m) in acc.items()]
    rows.sort(key=lambda r: -r["total_ms"])
    return rows


def step_windows(events: list[dict], ivs: list[dict]) -> list[dict]:
    """Return {pid, step, ts, dur} per recorded step: from the step bars, else between step
    markers."""
    wins = [{"pid": i["pid"], "step": i["args"].get("step"), "ts": i["ts"], "dur": i["dur"]}
            for i in ivs if i["cat"] == CAT_STEP and i["name"] == STEP]
    if not wins:
        marks = collections.defaultdict(list)
        for e in events:
            if e.get("ph") in ("i", "I") and e.get("cat") == CAT_STEP:
                marks[e.get("pid", 0)].append((float(e["ts"]), (e.get("args") or {}).get("step")))
        for pid, ms in marks.items():
            ms.sort()
            for (t0, s), (t1, _) in zip(ms, ms[1:]):
                wins.append({"pid": pid, "step": s, "ts": t0, "dur": t1 - t0})
    wins.sort(key=lambda w: (w["step"] if w["step"] is not None else -1, w["pid"]))
    return wins


def _union_us(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def per_step_comm(ivs: list[dict], windows: list[dict]) -> list[dict]:
    """Return per step and rank: step ms, communication ms (union and sum), phase events in it."""
    rows = []
    phases = _phases(ivs)
    for w in windows:
        t0, t1 = w["ts"], w["ts"] + w["dur"]
        inside = [i for i in phases if i["pid"] == w["pid"] and t0 <= i["ts"] < t1]
        comm = [(i["ts"], min(i["ts"] + i["dur"], t1)) for i in inside
                if i["cat"] in COMM_CATEGORIES]
        union = _union_us(comm)
        rows.append({"rank": w["pid"], "step": w["step"], "step_ms": w["dur"] / 1e3,
                     "comm_ms": union / 1e3, "comm_sum_ms": sum(b - a for a, b in comm) / 1e3,
                     "comm_pct": 100.0 * union / w["dur"] if w["dur"] > 0 else None,
                     "events": len(inside)})
    return rows


def summarize(path: str, top: int = 10) -> dict:
    """Load a trace and return its summary: top phases, per-step communication, totals."""
    data = load_trace(path)
    events = data["traceEvents"]
    ivs = intervals(events)
    wins = step_windows(events, ivs)
    return {"path": path, "events": len(events), "ranks": sorted({i["pid"] for i in ivs}),
            "top_phases": phase_totals(ivs)[:top], "steps": per_step_comm(ivs, wins),
            "dropped_events": _dropped(data)}


def _dropped(data: dict) -> int:
    other = data.get("otherData", {})
    if "ranks" in other:  # merged
        return sum(r.get("dropped_events", 0) for r in other["ranks"])
    return other.get("dropped_events", 0)


def format_summary(s: dict) -> str:
    """Render a summary as plain-text tables."""
    lines = [f"{s['path']}: {s['events']} events, ranks {s['ranks']}"
             + (f", {s['dropped_events']} DROPPED (buffer full)" if s["dropped_events"] else "")]
    lines.append("")
    lines.append("Top phases by total time")
    lines.append(f"{'phase':<16}{'cat':<10}{'count':>8}{'total ms':>12}{'mean ms':>10}"
                 f"{'max ms':>10}")
    for r in s["top_phases"]:
        lines.append(f"{r['name'][:15]:<16}{r['cat'][:9]:<10}{r['count']:>8}{r['total_ms']:>12.3f}"
                     f"{r['mean_ms']:>10.3f}{r['max_ms']:>10.3f}")
    lines.append("")
    lines.append("Communication per step (union of comm/agree phases)")
    lines.append(f"{'step':>6}{'rank':>6}{'step ms':>10}{'comm ms':>10}{'comm %':>8}"
                 f"{'sum ms':>10}{'events':>8}")
    for r in s["steps"]:
        pct = f"{r['comm_pct']:.1f}" if r["comm_pct"] is not None else "-"
        lines.append(f"{str(r['step']):>6}{r['rank']:>6}{r['step_ms']:>10.3f}{r['comm_ms']:>10.3f}"
                     f"{pct:>8}{r['comm_sum_ms']:>10.3f}{r['events']:>8}")
    if not s["steps"]:
        lines.append("  (no step markers: call mark_step(n) at the start of each step)")
    return "\n".join(lines)


def _lane_names(events: list[dict]) -> dict:
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[(e.get("pid", 0), e.get("tid", 0))] = (e.get("args") or {}).get("name")
    return names


def plot_step(path: str, out_png: str, step: int | None = None) -> str:
    """Draw one step's phases as bars per rank and lane into a PNG; return its path.

    `step` defaults to the first step recorded whole.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = load_trace(path)
    events = data["traceEvents"]
    ivs = intervals(events)
    wins = step_windows(events, ivs)
    if not wins:
        raise ValueError(f"plot_step: {path} has no step markers; record with mark_step(n) "
                         "or plot a trace that has steps")
    steps_seen = [w["step"] for w in wins]
    if step is None:
        step = steps_seen[0]
    chosen = [w for w in wins if w["step"] == step]
    if not chosen:
        raise ValueError(f"plot_step: step {step} is not in {path}; recorded steps: "
                         f"{sorted(set(steps_seen), key=lambda x: (x is None, x))}")
    lanes_named = _lane_names(events)
    origin = min(w["ts"] for w in chosen)
    bars = []
    for w in chosen:
        t0, t1 = w["ts"], w["ts"] + w["dur"]
        bars += [i for i in _phases(ivs) if i["pid"] == w["pid"] and t0 <= i["ts"] < t1]
    lanes = sorted({(i["pid"], i["tid"]) for i in bars})
    names = sorted({i["name"] for i in bars},
                   key=lambda n: (_PIPELINE.index(n) if n in _PIPELINE else len(_PIPELINE), n))
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    colour = {n: cmap(k % cmap.N) for k, n in enumerate(names)}
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.42 * max(1, len(lanes))))
    for row, lane in enumerate(lanes):
        mine = [i for i in bars if (i["pid"], i["tid"]) == lane]
        for n in names:
            segs = [((i["ts"] - origin) / 1e3, max(i["dur"] / 1e3, 1e-4))
                    for i in mine if i["name"] == n]
            if segs:
                ax.broken_barh(segs, (row - 0.4, 0.8), facecolors=colour[n])
    for w in chosen:
        ax.axvline((w["ts"] + w["dur"] - origin) / 1e3, color="grey", lw=0.8, ls="--")
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"rank {p} · {lanes_named.get((p, t), t)}" for p, t in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step began")
    ax.set_title(f"step {step}: phases per rank and lane")
    from matplotlib.patches import Patch
    ax.legend(handles=[Patch(color=colour[n], label=n) for n in names], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def main(argv=None) -> int:
    """Command line: print the summary of a trace, optionally plot one step."""
    p = argparse.ArgumentParser(prog="python -m gradientflow.observability.summarize",
                                description="Summarise a GradientFlow Chrome-trace timeline.")
    p.add_argument("trace", help="a per-rank or merged trace (.json)")
    p.add_argument("--plot", metavar="OUT.png", help="draw one step's phases per lane into a PNG")
    p.add_argument("--step", type=int, default=None, help="the step to plot (default: first)")
    p.add_argument("--top", type=int, default=10, help="phases to list (default 10)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    a = p.parse_args(argv)
    try:
        s = summarize(a.trace, top=a.top)
        print(json.dumps(s, indent=1) if a.json else format_summary(s))
        if a.plot:
            print(f"plot: {plot_step(a.trace, a.plot, step=a.step)}")
    except (OSError, ValueError) as exc:
        print(f"summarize: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
