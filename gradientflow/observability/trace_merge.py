"""Reading traces back and merging the per-rank files into one (pid = rank);
`python -m gradientflow.observability.timeline OUT IN...` runs `_main`.

Leaf module: stdlib only.
"""
from __future__ import annotations

import json
import os
from typing import Iterable


def load_trace(path: str) -> dict:
    """Load a trace file, repairing one cut short by a killed process (missing closing bracket)."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        body = text.rstrip().rstrip(",")
        # A kill can land mid-line: drop the partial last event.
        for candidate in (body + "\n]}", body[: body.rfind("\n")].rstrip().rstrip(",") + "\n]}"):
            try:
                data = json.loads(candidate)
                break
            except json.JSONDecodeError:
                continue
        else:
            raise ValueError(f"load_trace: {path} is not a Chrome trace (JSON) and could not be "
                             "repaired; was it written by gradientflow's timeline?") from None
    if isinstance(data, list):  # the JSON-array flavour of the format
        data = {"traceEvents": data}
    if "traceEvents" not in data:
        raise ValueError(f"load_trace: {path} has no traceEvents list; not a Chrome trace")
    return data


def merge(paths: Iterable[str], out: str, align: str = "auto") -> str:
    """Merge per-rank traces into one file, pid = rank; return `out`.

    Args:
        paths: the per-rank files.
        out: the merged file.
        align: "none" keeps timestamps (exact on one host: one monotonic clock), "wall" shifts
            each rank by its wall-clock offset (for ranks on several hosts, as good as NTP),
            "auto" picks "wall" only when the files come from more than one host.
    """
    if align not in ("auto", "none", "wall"):
        raise ValueError(f"merge align={align!r}: choose 'auto', 'none' or 'wall'")
    traces = [load_trace(p) for p in paths]
    if not traces:
        raise ValueError("merge: no trace files given")
    hosts = {t.get("otherData", {}).get("host") for t in traces}
    if align == "auto":
        align = "wall" if len(hosts) > 1 else "none"
    ref = traces[0].get("otherData", {}).get("wall_minus_mono_us", 0.0)
    events, ranks = [], []
    for index, t in enumerate(traces):
        other = t.get("otherData", {})
        rank = other.get("rank", index)
        ranks.append(other)
        shift = other.get("wall_minus_mono_us", ref) - ref if align == "wall" else 0.0
        for ev in t["traceEvents"]:
            ev = dict(ev)
            ev["pid"] = rank
            if shift and "ts" in ev and ev.get("ph") != "M":
                ev["ts"] = ev["ts"] + shift
            events.append(ev)
    merged = {"traceEvents": events, "displayTimeUnit": "ms",
              "otherData": {"merged_from": [os.fspath(p) for p in paths], "align": align,
                            "ranks": ranks}}
    tmp = f"{out}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(merged, fh)
    os.replace(tmp, out)
    return out


def _main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m gradientflow.observability.timeline",
                                description="Merge per-rank GradientFlow traces into one "
                                "(pid = rank).")
    p.add_argument("out", help="merged trace to write")
    p.add_argument("inputs", nargs="+", help="per-rank trace files")
    p.add_argument("--align", default="auto", choices=("auto", "none", "wall"))
    a = p.parse_args(argv)
    print(merge(a.inputs, a.out, align=a.align))
    return 0
