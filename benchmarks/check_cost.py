"""What checking every collective costs: this checkout against one before the check, side by side.

Runs `bench_collectives.py` (small synchronous collectives, gradientflow against plain gloo
in the same launch) and `bench_fusion.py` (a ResNet-50 gradient list, fused) alternately in
the `--before` checkout and in this one, `--runs` times each, so both see the same machine
load, and writes one table of the added cost per call.

    python benchmarks/check_cost.py --before DIR [--runs 2] [--lock /work/timing.lock]

DIR is a throwaway checkout of the commit before the per-call check (git worktree add DIR
<commit>): this checkout's bench_collectives.py and bench_fusion.py are copied into it, so only
the package differs. `--no-run` only writes the table from the run folders already there.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import fmt, machine_line, markdown_table, results_dir, write_result

HERE = Path(__file__).resolve().parent.parent
COLL = ["--sizes", "4096,65536", "--reps", "60", "--worlds", "2,4"]
FUSION = ["--models", "resnet50", "--worlds", "2", "--tiers", "none", "--thresholds", "128",
          "--solos", "4", "--cycles", "3", "--reps", "11", "--launches", "2"]


@contextlib.contextmanager
def locked(path: str | None):
    """Hold an exclusive flock on `path` (other timing jobs wait), or nothing."""
    if not path:
        yield
        return
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def run(tree: Path, script: str, args: list, out: Path) -> dict:
    """Run benchmarks/<script> in `tree` with this checkout's copy of it; its JSON."""
    log = out.with_suffix(".log")
    cmd = [sys.executable, str(HERE / "benchmarks" / script), *args, "--out", str(out)]
    if tree != HERE:  # the script from here, the package from `tree`
        cmd[1] = str(tree / "benchmarks" / script)
        shutil.copy(HERE / "benchmarks" / script, cmd[1])
    with open(log, "w") as fh:
        subprocess.run(cmd, cwd=tree, stdout=fh, stderr=subprocess.STDOUT, check=True,
                       timeout=1800)
    return json.loads(next(out.glob("*.json")).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="checkout before the check")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--lock", default=None, help="a lock file shared with other timing jobs")
    ap.add_argument("--out", type=Path, default=Path(results_dir("check_cost")))
    ap.add_argument("--no-run", action="store_true",
                    help="only write the table from the run folders already in --out")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    coll: dict = {"before": [], "after": []}
    fusion: dict = {"before": [], "after": []}
    loads: list = []
    if args.no_run:
        for side in coll:
            for i in range(args.runs):
                for name, into in (("collectives", coll), ("fusion", fusion)):
                    folder = args.out / f"{name}_{side}_{i + 1}"
                    into[side].append(json.loads(next(folder.glob("*.json")).read_text()))
        loads = [m["machine"]["loadavg"][0] for side in ("before", "after")
                 for m in coll[side]]
    with locked(None if args.no_run else args.lock):
        for i in range(0 if args.no_run else args.runs):
            for side, tree in (("before", args.before.resolve()), ("after", HERE)):
                loads.append(os.getloadavg()[0])
                t0 = time.monotonic()
                coll[side].append(run(tree, "bench_collectives.py", COLL,
                                      args.out / f"collectives_{side}_{i + 1}"))
                fusion[side].append(run(tree, "bench_fusion.py", FUSION,
                                        args.out / f"fusion_{side}_{i + 1}"))
                print(f"{side} {i + 1}: {time.monotonic() - t0:.0f} s", flush=True)
    rows = []
    for r0 in coll["after"][0]["rows"]:
        key = (r0["ranks"], r0["op"], r0["size"])

        def pick(side, col):
            return [next(r[col] for r in run_["rows"]
                         if (r["ranks"], r["op"], r["size"]) == key) for run_ in coll[side]]
        over_b, over_a = pick("before", "overhead us"), pick("after", "overhead us")
        rows.append({"ranks": key[0], "op": key[1], "size": key[2],
                     "gloo ms": statistics.median(pick("after", "gloo ms")),
                     "gf ms before": statistics.median(pick("before", "gf ms")),
                     "gf ms after": statistics.median(pick("after", "gf ms")),
                     "added us": statistics.median(over_a) - statistics.median(over_b),
                     "gf/gloo before": statistics.median(pick("before", "gf/gloo busbw")),
                     "gf/gloo after": statistics.median(pick("after", "gf/gloo busbw"))})

    def fused(side, col):
        return [next(r[col] for r in f["rows"] if r.get("tier") == "loopback")
                for f in fusion[side]]
    frows = [{"side": side, "default ms": statistics.median(fused(side, "default ms")),
              "buckets / default": statistics.median(fused(side, "buckets / default")),
              "runs": ", ".join(fmt(v) for v in fused(side, "buckets / default"))}
             for side in ("before", "after")]
    md = (f"## The per-call check's cost: before and after, side by side\n\n{machine_line()}\n"
          f"1-minute load averages recorded by the runs: "
          f"{', '.join(f'{x:.1f}' for x in loads)}.\n\n"
          f"Small synchronous collectives (`bench_collectives.py {' '.join(COLL)}`), medians of "
          f"{args.runs} runs per side, interleaved; 'added us' is the rise of gradientflow's "
          "overhead over gloo (measured in the same launch) from before to after:\n\n"
          + markdown_table(list(rows[0]), rows) +
          f"\n\nThe fused path, a ResNet-50 gradient list of 161 tensors on 2 ranks "
          f"(`bench_fusion.py {' '.join(FUSION)}`); the check rides in the agreement round "
          "the batch already pays, and solo allreduces are checked in batched rounds:\n\n"
          + markdown_table(list(frows[0]), frows) +
          f"\n\nCommand: `python benchmarks/check_cost.py --before DIR --runs {args.runs}`\n")
    write_result(args.out, "check_cost", {"collectives": rows, "fusion": frows,
                                          "loads": loads}, md)
    print(md)


if __name__ == "__main__":
    main()
