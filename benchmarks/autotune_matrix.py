"""Gather every launch of bench_autotune.py under one root into one table: matrix.md and .json.

Each folder `t<T>_w<N>_<models>` (T `none` for loopback or the emulated Gbit/s, N the rank
count) holds one launch: its autotune.json (the raw per-cell data) and log.txt (the `start:`
and `end:` lines with the 1-minute load average at both). Every cell's row is recomputed from
the raw data by the benchmark's own `_row`, with the launch's load and UTC span beside it.

    python benchmarks/autotune_matrix.py [--root benchmarks/results/autotune]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_autotune import _row  # noqa: E402
from benchmarks.bench_fusion import _tier_label  # noqa: E402
from benchmarks.common import markdown_table  # noqa: E402

FOLDER = re.compile(r"^t(?P<tier>[^_]+)_w(?P<ranks>\d+)_(?P<models>.+)$")
LOG_LINE = re.compile(r"^(?P<what>start|end): (?P<utc>\d\d:\d\d:\d\d)\s.*load average: "
                      r"(?P<load>[\d.]+)", re.M)
TIERS = ("none", "10")  # the full matrix: loopback and the emulated 10 Gbit/s network
WORLDS = (2, 4)
MODELS = ("bert-base", "resnet50", "alexnet")  # also the table's order within a tier and size
# The table's columns: _row's, less the grid phase's own best and the setting that mattered
# most (both stay in matrix.json), plus the launch's load and time.
COLUMNS = ["tier", "ranks", "model", "tune steps", "default ms", "autotune ms", "best grid ms",
           "autotune / best grid", "within 5%", "same-rep best", "gain over defaults",
           "own estimate", "kept defaults", "chosen", "best grid", "load 1-min start/end", "UTC"]
MS = ("default ms", "autotune ms", "best grid ms")
HEADER = """\
## Autotune against a grid of the same settings: every cell run

One launch per folder: `python benchmarks/bench_autotune.py --tiers T --worlds N --models M
--reps R --h2h H [--steps S] --seed 0 --out DIR` with T, N and M from the folder's name
(t<T>_w<N>_<models>), R 5 and H 8 at 2 ranks, R 3 and H 6 at 4 ranks, and R 3, H 6, S 2 for
BERT-base at 10 Gbit/s or 4 ranks (S 3 otherwise); the folder's log.txt has its start and end
times with the 1-minute load average at both. Each ran under the machine-wide timing lock on a
2-core machine, some while other jobs shared it (the load column: 1-minute load average at
start and end; 2 or 4 is the launch's own ranks). Autotune: 12 trials of 1 + 4 steps, then
2 race rounds of the defaults and 2 finalists: 91 steps. Ratios and gains come from the
head-to-head reps (see docs/AUTOTUNE.md, "Benchmark"). This table and matrix.json are written by
`python benchmarks/autotune_matrix.py`, which recomputes every row from each folder's raw data
(autotune.json) with the benchmark's own `_row`; where autotune kept the defaults, each rep's
mean of its series and the defaults' stands for both (the per-folder autotune.md of the first
launches predates that and gives the two series apart).
"""


def tier_of(name: str) -> str:
    """The tier label bench_autotune gives a folder's tier (`none` or Gbit/s)."""
    return _tier_label(None if name.lower() in ("none", "loopback") else float(name))


def read_log(path: str) -> dict:
    """The launch's 1-minute load average and UTC time at start and end, from its log.txt."""
    seen = {}
    if os.path.exists(path):
        with open(path) as f:
            seen = {m["what"]: m for m in LOG_LINE.finditer(f.read())}
    start, end = seen.get("start"), seen.get("end")
    return {"load 1-min start/end": f"{start['load'] if start else '-'}/"
                                    f"{end['load'] if end else '-'}",
            "UTC": f"{start['utc'] if start else '-'}-{end['utc'] if end else '-'}"}


def _order(row: dict) -> tuple:
    model = row["model"]
    return (row["tier"] == "loopback", row["ranks"],
            MODELS.index(model) if model in MODELS else len(MODELS), model)


def gather(root: str) -> tuple[list[dict], list[tuple[str, int, str]]]:
    """Every cell's row under `root`, sorted, and the cells of the full matrix with no folder."""
    rows = []
    for name in sorted(os.listdir(root)):
        folder = FOLDER.match(name)
        if not folder or not os.path.isdir(os.path.join(root, name)):
            continue
        with open(os.path.join(root, name, "autotune.json")) as f:
            raw = json.load(f)["raw"]
        log = read_log(os.path.join(root, name, "log.txt"))
        for key, cells in raw.items():  # "<tier label> <ranks>", as bench_autotune keys it
            tier, n = key.rsplit(" ", 1)
            if (tier, int(n)) != (tier_of(folder["tier"]), int(folder["ranks"])):
                raise ValueError(f"autotune_matrix: {name}/autotune.json holds cells of "
                                 f"{key!r}, not of the folder's tier and ranks: rename the "
                                 "folder after the launch it holds")
            rows += [{**_row(tier, int(n), model, r), **log} for model, r in cells.items()]
    rows.sort(key=_order)
    have = {(r["tier"], r["ranks"], r["model"]) for r in rows}
    missing = [(t, n, m) for t, n, m in itertools.product(TIERS, WORLDS, MODELS)
               if (tier_of(t), n, m) not in have]
    return rows, missing


def summary(rows: list[dict], missing: list[tuple[str, int, str]]) -> str:
    """One line: cells within 5% of the grid's best, and the cells of the matrix not run."""
    within = sum(r["within 5%"] == "yes" for r in rows)
    gone = ", ".join(f"({tier_of(t)}, {n}, {m})" for t, n, m in missing) or "none"
    return f"{within} of {len(rows)} cells within 5% of the best grid point; no folder: {gone}"


def render(rows: list[dict]) -> str:
    """matrix.md: the header and the table (times to 0.1 ms)."""
    shown = [{**r, **{c: f"{r[c]:.1f}" for c in MS}} for r in rows]
    return HEADER + "\n" + markdown_table(COLUMNS, shown) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="benchmarks/results/autotune",
                    help="the folder holding one t<T>_w<N>_<models> folder per launch")
    args = ap.parse_args(argv)
    rows, missing = gather(args.root)
    with open(os.path.join(args.root, "matrix.md"), "w") as f:
        f.write(render(rows))
    with open(os.path.join(args.root, "matrix.json"), "w") as f:
        json.dump({"rows": rows}, f, indent=1)
        f.write("\n")
    print(summary(rows, missing))
    return 0


if __name__ == "__main__":
    sys.exit(main())
