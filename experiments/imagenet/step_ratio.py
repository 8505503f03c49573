"""Paired step times of run_experiment.py runs: one setting's over another's, seed by seed.

Each run's time per training step is its last epoch's `train_time_s / steps` (the earlier
epochs hold the warm-up). Runs of the same seed were made side by side (run_experiment
interleaves the settings seed by seed), so the ratio is taken per seed and summarised by its
median, its geometric mean and the 95% Student t interval of the mean log ratio; the phases
train.py times (data, forward, backward, optimizer step) and a rank's CPU time are compared
the same way, as the median per-seed difference in ms a step.

    python experiments/imagenet/step_ratio.py new=DIR:gf-powersgd-4 old=DIR2:gf-powersgd-4 \\
        hook=DIR:powersgd-4 --pairs new/old old/hook new/hook --out DIR/results.md

A RUN is NAME=FOLDER:SETTING (FOLDER: a run_experiment --out folder, or its model's
subfolder); the folders may come from different trees of the code, which is what a before and
after comparison needs.
"""
from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import converge_report  # noqa: E402
import run_experiment as rx  # noqa: E402


def runs_of(folder: Path, key: str) -> dict:
    """{seed: last epoch's record} of one setting's runs in a run_experiment folder, with
    `cpu_ms` (cpu_ms_per_step) added where the log has it."""
    logs = folder / "logs"
    out = {}
    for path in sorted(logs.glob(f"{key}-seed*.jsonl")):
        seed = path.name[len(key) + len("-seed"):-len(".jsonl")]
        rows = [r for r in rx.read_log(path) if "train_time_s" in r]
        if seed.isdigit() and rows:
            cpu = cpu_ms_per_step(rows[-2], rows[-1]) if len(rows) > 1 else None
            threads = thread_ms_per_step(rows[-2], rows[-1]) if len(rows) > 1 else {}
            out[int(seed)] = {**rows[-1], **({"cpu_ms": cpu} if cpu is not None else {}),
                              **({"thread_ms": threads} if threads else {})}
    return out


def thread_ms_per_step(prev: dict, last: dict) -> dict:
    """The logging rank's CPU per step in the last epoch by kind of thread (train.py's
    `thread_cpu_s`, cumulative), in ms; {} where either record lacks it."""
    a, b = prev.get("thread_cpu_s"), last.get("thread_cpu_s")
    if not a or not b:
        return {}
    return {k: (v - a.get(k, 0.0)) / last["steps"] * 1e3 for k, v in b.items()}


def cpu_ms_per_step(prev: dict, last: dict) -> float | None:
    """A rank's CPU per step in the last epoch, in ms, the mean over ranks: train.py logs each
    rank's CPU seconds so far after every epoch (`rank_cpu_s`), so the last epoch's is the
    difference to the one before; its evaluation is included (the same for every setting of a
    stage). None where either record lacks it."""
    a, b = prev.get("rank_cpu_s"), last.get("rank_cpu_s")
    if not a or not b or len(a) != len(b):
        return None
    return statistics.mean(y - x for x, y in zip(a, b)) / last["steps"] * 1e3


def step_ms(record: dict) -> float:
    """Training time per step of one epoch's record, in ms (converge_report's, of that epoch
    alone)."""
    return converge_report.step_ms([record])


def compare(a: dict, b: dict) -> dict | None:
    """a's step time over b's for the seeds both have: per-seed ratios, their median,
    geometric mean and 95% interval, and the median per-seed difference of each phase and of a
    rank's CPU (ms a step; `cpu_delta` None where the logs lack it). None with fewer than two
    seeds in common."""
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return None
    ratios = {s: step_ms(a[s]) / step_ms(b[s]) for s in seeds}
    ci = converge_report.paired_interval({s: math.log(r) for s, r in ratios.items()},
                                         {s: 0.0 for s in seeds})
    phases = {}
    for name in a[seeds[0]].get("phase_s", {}):
        diffs = [(a[s]["phase_s"][name] / a[s]["steps"] - b[s]["phase_s"][name] / b[s]["steps"])
                 * 1e3 for s in seeds if name in b[s].get("phase_s", {})]
        if diffs:
            phases[name] = statistics.median(diffs)
    cpu = [a[s]["cpu_ms"] - b[s]["cpu_ms"] for s in seeds
           if "cpu_ms" in a[s] and "cpu_ms" in b[s]]
    both = [s for s in seeds if "thread_ms" in a[s] and "thread_ms" in b[s]]
    kinds = sorted({k for s in both for k in (*a[s]["thread_ms"], *b[s]["thread_ms"])})
    threads = {k: tuple(statistics.median(x) for x in zip(*[
        (a[s]["thread_ms"].get(k, 0.0), b[s]["thread_ms"].get(k, 0.0),
         a[s]["thread_ms"].get(k, 0.0) - b[s]["thread_ms"].get(k, 0.0)) for s in both]))
        for k in kinds}
    return {"seeds": seeds, "ratios": ratios, "median": statistics.median(ratios.values()),
            "geomean": math.exp(ci["mean"]), "low": math.exp(ci["low"]),
            "high": math.exp(ci["high"]),
            "a_ms": statistics.median(step_ms(a[s]) for s in seeds),
            "b_ms": statistics.median(step_ms(b[s]) for s in seeds), "phases": phases,
            "cpu_delta": statistics.median(cpu) if cpu else None, "threads": threads}


def table(rows: list) -> str:
    """The markdown table of (pair name, compare() result) rows."""
    phases = list(dict.fromkeys(p for _, r in rows for p in r["phases"]))  # train.py's order
    head = (["pair", "seeds", "ms a step (medians)", "median", "geometric mean",
             "95% interval", "per seed"] + [f"{p} Δ ms" for p in phases]
            + ["CPU Δ ms a step, per rank"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in rows:
        cells = [name, str(len(r["seeds"])), f"{r['a_ms']:.1f} / {r['b_ms']:.1f}",
                 f"{r['median']:.3f}", f"{r['geomean']:.3f}",
                 f"{r['low']:.3f}-{r['high']:.3f}",
                 f"{min(r['ratios'].values()):.2f}-{max(r['ratios'].values()):.2f}"]
        cells += [f"{r['phases'][p]:+.2f}" if p in r["phases"] else "-" for p in phases]
        cells.append("-" if r["cpu_delta"] is None else f"{r['cpu_delta']:+.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def thread_table(rows: list) -> str:
    """The markdown table of each pair's CPU a step by kind of thread ('' where no log has
    it): medians over seeds of each side and of the per-seed difference; a kind idle on both
    sides is left out."""
    lines = []
    for name, r in rows:
        for kind, (a_ms, b_ms, delta) in r.get("threads", {}).items():
            if a_ms or b_ms or delta:
                lines.append(f"| {name} | {kind} | {a_ms:.2f} | {b_ms:.2f} | {delta:+.2f} |")
    if not lines:
        return ""
    return "\n".join(["| pair | thread | ms a step, first | second | Δ (per seed) |",
                      "|---|---|---|---|---|", *lines])


def parse_run(text: str) -> tuple[str, Path, str]:
    """NAME=FOLDER:SETTING."""
    name, _, rest = text.partition("=")
    folder, _, key = rest.rpartition(":")
    if not name or not folder or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=FOLDER:SETTING")
    return name, Path(folder), key


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=parse_run, help="NAME=FOLDER:SETTING")
    ap.add_argument("--pairs", nargs="+", required=True, help="A/B: A's step time over B's")
    ap.add_argument("--out", type=Path, default=None, help="write the table here (markdown)")
    ap.add_argument("--title", default="Paired step times")
    args = ap.parse_args(argv)
    runs = {name: runs_of(folder, key) for name, folder, key in args.runs}
    rows = []
    for pair in args.pairs:
        a, _, b = pair.partition("/")
        if a not in runs or b not in runs:
            ap.error(f"--pairs {pair}: name both sides among {sorted(runs)}")
        result = compare(runs[a], runs[b])
        if result is None:
            ap.error(f"--pairs {pair}: fewer than two seeds that both ran")
        rows.append((pair, result))
    text = (f"## {args.title}\n\nTime per training step of the last epoch, paired by seed "
            "(the settings of a seed ran side by side); the ratio's geometric mean and 95% "
            "Student t interval are of the per-seed log ratios; a phase's Δ is the median "
            "per-seed difference, first minus second, in ms a step; CPU Δ: the same of a "
            "rank's CPU time a step (the mean over ranks; the epoch's evaluation included, "
            "alike for both).\n\n" + table(rows)
            + (f"\n\nThe logging rank's CPU a step by kind of thread (train.py's "
               f"`thread_cpu_s`; Python's threads by name, gloo's by the OS's):\n\n"
               f"{thread_table(rows)}" if thread_table(rows) else "")
            + "\n\nCommand: `python experiments/imagenet/step_ratio.py "
            + shlex.join(sys.argv[1:] if argv is None else argv) + "`\n")
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
