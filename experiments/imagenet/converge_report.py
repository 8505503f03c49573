"""The convergence stage's report: test top-1 per model and setting, the paired per-seed
difference to the baseline (DDP unless a stage names another) with its 95% Student t interval,
the time per training step, and what each run cost.

A run's test top-1 is read with protocol.report_top1 (the one test evaluation after the last
epoch); the validation top-1 of the last epoch is shown beside it. The difference to DDP is
paired by seed (the same initialisation and data order): for the n seeds both finished,
d_i = setting_i - DDP_i, and the interval is mean(d) -/+ t(0.975, n-1) * sd(d) / sqrt(n).
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import protocol
import run_experiment as rx

# The goal the issue sets the CSC default: within this many points of DDP's test top-1.
GOAL_POINTS = 0.3
BASELINE = "ddp-gloo"
OURS = "csc-default"
LABELS = {"alexnet_shaped": "AlexNet-shaped", "resnet_shaped": "ResNet-shaped",
          "resnet18": "ResNet-18 (32x32)"}
TITLES = {"fashion-mnist": "Fashion-MNIST at convergence", "digits": "Digits at convergence"}


def t_quantile(p: float, dof: int) -> float:
    """Student t's p-quantile with `dof` degrees of freedom."""
    from scipy.stats import t

    return float(t.ppf(p, dof))


def paired_interval(values: dict, base: dict, level: float = 0.95) -> dict | None:
    """Mean paired difference values - base over the seeds both have, with its two-sided
    Student t interval (n - 1 degrees of freedom); None with fewer than two pairs."""
    seeds = sorted(set(values) & set(base))
    diffs = [values[s] - base[s] for s in seeds]
    if len(diffs) < 2:
        return None
    mean, sd = statistics.mean(diffs), statistics.stdev(diffs)
    half = t_quantile(0.5 + level / 2, len(diffs) - 1) * sd / math.sqrt(len(diffs))
    return {"seeds": seeds, "diffs": diffs, "mean": mean, "sd": sd, "low": mean - half,
            "high": mean + half, "dof": len(diffs) - 1}


def load(folder: Path, key: str, seeds: list, epochs: int) -> dict:
    """{seed: (log, meta)} of the finished runs of one setting with a test evaluation."""
    runs = {}
    for seed in seeds:
        path = folder / "logs" / f"{key}-seed{seed}.jsonl"
        log = rx.read_log(path) if path.exists() else []
        if [r["epoch"] for r in log] == list(range(epochs)) and "test_top1" in log[-1]:
            runs[seed] = (log, rx.read_meta(folder, key, seed))
    return runs


def step_ms(log: list) -> float:
    """A run's training time per step in milliseconds (every epoch's steps, evaluation out)."""
    return 1000 * sum(r["train_time_s"] for r in log) / sum(r["steps"] for r in log)


def summarise(out: Path, models: list, settings: list, seeds: list, epochs: int,
              baseline: str = BASELINE) -> dict:
    """{model: {setting: row}}: test and validation top-1 per seed, the paired difference to
    `baseline`, each run's time per step, wall and CPU seconds."""
    result = {}
    for model in models:
        rows = {}
        for key in settings:
            runs = load(out / model, key, seeds, epochs)
            if not runs:
                continue
            rows[key] = {
                "label": rx.SETTINGS[key][0],
                "test_top1": {s: protocol.report_top1(log) for s, (log, _) in runs.items()},
                "val_top1": {s: protocol.selection_top1(log[-1]) for s, (log, _) in runs.items()},
                "val_curve": [statistics.mean(log[e]["val_top1"] for log, _ in runs.values())
                              for e in range(epochs)],
                "step_ms": {s: step_ms(log) for s, (log, _) in runs.items()},
                "wire_kb": {s: log[-1].get("wire_bytes_per_step", 0) / 1e3
                            for s, (log, _) in runs.items()},
                "wall_s": {s: m.get("wall_s") for s, (_, m) in runs.items()},
                "cpu_s": {s: sum(log[-1].get("rank_cpu_s") or [0]) for s, (log, _) in
                          runs.items()},
                "commits": sorted({m.get("commit", "?") for _, m in runs.values()}),
                "loadavg": {s: (m.get("loadavg_before") or [None])[0] for s, (_, m) in
                            runs.items()},
            }
        base = rows.get(baseline)
        for key, row in rows.items():
            row["vs_ddp"] = (paired_interval(row["test_top1"], base["test_top1"])
                             if base and key != baseline else None)
            row["step_vs_base"] = (paired_interval(row["step_ms"], base["step_ms"])
                                   if base and key != baseline else None)
        result[model] = rows
    return result


def _mean_sd(values) -> str:
    values = list(values)
    if len(values) < 2:
        return f"{values[0]:.2f}" if values else "-"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def _minutes(values) -> str:
    values = [v for v in values if v]
    return f"{statistics.mean(values) / 60:.1f}" if values else "-"


def verdict(row: dict) -> str:
    """The goal, said with the interval: the mean within GOAL_POINTS, and whether the interval
    rules out a larger loss."""
    iv = row["vs_ddp"]
    if iv is None:
        return "not judged: fewer than two seeds paired with DDP"
    within = abs(iv["mean"]) <= GOAL_POINTS
    ruled_out = iv["low"] >= -GOAL_POINTS
    return (f"mean difference {iv['mean']:+.2f} points: **{'met' if within else 'missed'}**; "
            f"the 95% interval [{iv['low']:+.2f}, {iv['high']:+.2f}] "
            + ("rules out" if ruled_out else "does not rule out")
            + f" a loss of more than {GOAL_POINTS} points")


def progress(result: dict, models: list, settings: list, seeds: list) -> str | None:
    """A sentence naming the runs of the plan not finished yet, or None when all are."""
    planned = len(models) * len(settings) * len(seeds)
    done = sum(len(row["test_top1"]) for rows in result.values() for row in rows.values())
    if done >= planned:
        return None
    return (f"**In progress: {done} of {planned} runs finished.** The tables cover the finished "
            "runs only (the per-seed column names them); the same command goes on with the "
            "rest, seed by seed.")


def markdown(data: str, result: dict, seeds: list, epochs: int, command: str,
             baseline: str = BASELINE, title: str | None = None,
             plan: tuple | None = None) -> str:
    """The report; `plan` (models, settings): the runs planned, for a stage in progress."""
    base = "DDP" if baseline == BASELINE else rx.SETTINGS[baseline][0]
    lines = [f"# {title or TITLES[data]}", "",
             f"2 CPU ranks on loopback, warm-up + cosine over {epochs} epochs, seeds "
             f"{', '.join(map(str, seeds))} (report seeds: no choice of recipe or default saw "
             f"them). Every epoch is scored on the validation split held out of the training "
             f"set ({protocol.VAL_SPLITS[data]:,} images); the test set is read once, after the "
             f"last epoch. Top-1: mean ± standard deviation over seeds. Paired difference: "
             f"per seed, the setting's test top-1 minus {base}'s, with its 95% Student t "
             f"interval (n - 1 degrees of freedom). ms/step: training time per step (evaluation "
             f"out), mean over seeds, and the paired per-seed difference to {base}'s: a cost, "
             f"not a timing (the runs may share the machine with other work, which accuracy "
             f"does not depend on; the timed comparisons are make compare's). kB/step sent: "
             f"what one rank put on the wire per step in the last epoch. Cost: mean wall "
             f"minutes and CPU minutes (both ranks) per run.", ""]
    note = progress(result, *plan, seeds) if plan else None
    if note:
        lines += [note, ""]
    for model, rows in result.items():
        lines += [f"## {LABELS.get(model, model)}", "",
                  f"| setting | test top-1 (%) | per seed | Δ vs {base}, paired (points) | 95% "
                  "interval | final val top-1 (%) | ms/step | Δ ms/step, 95% interval | "
                  "kB/step sent | wall min/run | CPU min/run | commits |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for key, row in rows.items():
            iv = row["vs_ddp"]
            lines.append(
                f"| {row['label']} | {_mean_sd(row['test_top1'].values())} | "
                + ", ".join(f"{v:.2f}" for _, v in sorted(row["test_top1"].items())) + " | "
                + ("-" if iv is None else f"{iv['mean']:+.2f} (n={len(iv['diffs'])})") + " | "
                + ("-" if iv is None else f"[{iv['low']:+.2f}, {iv['high']:+.2f}]") + " | "
                + f"{_mean_sd(row['val_top1'].values())} | "
                + f"{statistics.mean(row['step_ms'].values()):.1f} | "
                + ("-" if row["step_vs_base"] is None else
                   "{mean:+.1f} [{low:+.1f}, {high:+.1f}]".format(**row["step_vs_base"])) + " | "
                + f"{statistics.mean(row['wire_kb'].values()):.1f} | "
                + f"{_minutes(row['wall_s'].values())} | "
                + f"{_minutes(row['cpu_s'].values())} | {', '.join(row['commits'])} |")
        if OURS in rows and baseline == BASELINE:
            lines += ["", f"Goal, the CSC default within {GOAL_POINTS} points of DDP: "
                      + verdict(rows[OURS]) + "."]
        marks = sorted({0, epochs // 4, epochs // 2, 3 * epochs // 4, epochs - 1})
        lines += ["", "Validation top-1 by epoch (mean over seeds):", "",
                  "| setting | " + " | ".join(f"epoch {e}" for e in marks) + " |",
                  "|---|" + "---|" * len(marks)]
        for row in rows.values():
            lines.append(f"| {row['label']} | "
                         + " | ".join(f"{row['val_curve'][e]:.2f}" for e in marks) + " |")
        lines.append("")
    lines += [f"Command: `{command}`", ""]
    return "\n".join(lines)


def write(out: Path, data: str, models: list, settings: list, seeds: list, epochs: int,
          command: str, baseline: str = BASELINE, title: str | None = None) -> str:
    """OUT/results.md and OUT/summary.json from the finished runs; returns the markdown."""
    result = summarise(out, models, settings, seeds, epochs, baseline)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    text = markdown(data, result, seeds, epochs, command, baseline, title, (models, settings))
    (out / "results.md").write_text(text)
    return text
