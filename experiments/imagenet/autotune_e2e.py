"""CSC training with autotune on against the defaults: time to the same accuracy, 2 CPU ranks.

The digits recipe of run_experiment.py (ResNet-18 at 32x32, CSC 1% with momentum correction,
FP16 wire) under torchrun, the same seed and data order in every run; the only difference is
GRADIENTFLOW_AUTOTUNE=1 (which also tunes the CSC chunk size: train.py hands its hook state to
the tuner). Runs are named `<setting>-<i>`; give them in an alternating order (ABBA) so both
settings meet the same drift of a shared machine:

    python experiments/imagenet/autotune_e2e.py --runs default-0,autotune-0 --epochs 6
    python experiments/imagenet/autotune_e2e.py --runs autotune-1,default-1 --epochs 6
    python experiments/imagenet/autotune_e2e.py --no-run          # the report only

A run whose log is complete is not run again. The report (OUT/autotune_e2e.md, .json): per
run, the training time (sum of the epochs' train_time_s, evaluation left out) until the first
epoch whose top-1 reaches the target, the highest top-1 every run reached; and what autotune
chose (its log).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from prepare import prepare  # noqa: E402
from run_experiment import read_log  # noqa: E402
from sweep import CSC_RECIPE, DIGITS_RECIPE, launch  # noqa: E402

from benchmarks.common import machine_line, markdown_table, median, write_result  # noqa: E402

CSC = ["--compression", "csc", "--density", "0.01", *CSC_RECIPE]
# 8 trials of 1 + 3 steps, then 2 race rounds of the defaults and 2 finalists: 57 steps, under
# 3 of the digits' 22-step epochs.
TUNER_ENV = {"GRADIENTFLOW_AUTOTUNE": "1", "GRADIENTFLOW_AUTOTUNE_TRIALS": "8",
             "GRADIENTFLOW_AUTOTUNE_STEPS": "3", "GRADIENTFLOW_AUTOTUNE_WARMUP": "1"}


def run(name: str, epochs: int, seed: int, out: Path, timeout: float) -> None:
    """Train one run (`default-<i>` or `autotune-<i>`) unless its log holds every epoch."""
    log = out / "logs" / f"{name}.jsonl"
    if log.exists() and len(read_log(log)) >= epochs:
        return
    setting = name.split("-")[0]
    if setting not in ("default", "autotune"):
        raise SystemExit(f"autotune_e2e: run {name!r} is neither default-<i> nor autotune-<i>")
    env = {}
    if setting == "autotune":
        env = {**TUNER_ENV, "GRADIENTFLOW_AUTOTUNE_LOG": str(out / "logs" / f"{name}.tune.jsonl"),
               "GRADIENTFLOW_AUTOTUNE_OUT": str(out / "logs" / f"{name}.tuned.json")}
        (out / "logs").mkdir(parents=True, exist_ok=True)
        Path(env["GRADIENTFLOW_AUTOTUNE_LOG"]).unlink(missing_ok=True)
    args = [str(prepare()), *DIGITS_RECIPE, *CSC, "--epochs", str(epochs), "--seed", str(seed),
            "--dist-backend", "gradientflow"]
    with mock.patch.dict(os.environ, env):  # launch() hands its environment to torchrun
        launch(args, log, out / "logs" / f"{name}.out", 2, timeout)


def report(out: Path) -> dict:
    """Time to the highest top-1 every run reached, per run and per setting."""
    logs = {p.stem: read_log(p) for p in sorted((out / "logs").glob("*-[0-9]*.jsonl"))
            if not p.name.endswith(".tune.jsonl")}
    logs = {k: v for k, v in logs.items() if v}
    if not logs:
        raise SystemExit(f"autotune_e2e: no run logs under {out / 'logs'}")
    target = min(max(r["val_top1"] for r in recs) for recs in logs.values())
    rows, per_setting = [], {}
    for name, recs in logs.items():
        t, reached = 0.0, None
        for r in recs:
            t += r["train_time_s"]
            if reached is None and r["val_top1"] >= target:
                reached = (r["epoch"], t)
        total = sum(r["train_time_s"] for r in recs)
        tune = out / "logs" / f"{name}.tune.jsonl"
        final = ([json.loads(x) for x in tune.read_text().splitlines() if x.strip()][-1]
                 if tune.exists() else {})
        rows.append({"run": name, "epochs": len(recs), "final top-1": recs[-1]["val_top1"],
                     "best top-1": max(r["val_top1"] for r in recs),
                     "epoch reaching target": reached[0], "time to target s": reached[1],
                     "train time s": total,
                     "img/s (median epoch)": median(r["images_per_s"] for r in recs),
                     "autotune chose": ", ".join(f"{k}={v:.4g}" if isinstance(v, float)
                                                 else f"{k}={v}"
                                                 for k, v in final.get("settings", {}).items())
                     if final.get("event") == "final" else "-",
                     "its own gain": (f"{final['gain']:+.1%}" if final.get("event") == "final"
                                      else "-")})
        per_setting.setdefault(name.split("-")[0], []).append(reached[1])
    summary = {k: median(v) for k, v in per_setting.items()}
    return {"target_top1": target, "rows": rows, "time_to_target_median_s": summary}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="default-0,autotune-0",
                    help="comma list of default-<i> / autotune-<i>, run in this order")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "autotune_e2e"))
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--no-run", action="store_true", help="only rebuild the report")
    args = ap.parse_args(argv)
    out = Path(args.out)
    load0 = os.getloadavg()[0]
    if not args.no_run:
        for name in [r.strip() for r in args.runs.split(",") if r.strip()]:
            run(name, args.epochs, args.seed, out, args.timeout)
    data = report(out)
    s = data["time_to_target_median_s"]
    ratio = (f"{s['default'] / s['autotune']:.3f}x" if {"default", "autotune"} <= set(s)
             else "n/a")
    cols = list(data["rows"][0])
    md = (f"## CSC 1% training, autotune on vs the defaults: time to the same top-1\n\n"
          f"{machine_line()} The 1-minute load average was {load0:.2f} when this command "
          "started (2 cores; with --no-run the runs may be older: see each log).\n\n"
          f"Digits, ResNet-18 at 32x32, 2 CPU ranks, seed {args.seed}, CSC 1% + momentum "
          f"correction, FP16 wire. Autotune: {TUNER_ENV} (engine settings and the CSC chunk "
          f"size). Target: {data['target_top1']:.2f}% top-1, the highest every run reached. "
          f"Time = training time to the first epoch at the target (evaluation left out). "
          f"Median time to target: {', '.join(f'{k} {v:.1f} s' for k, v in s.items())}; "
          f"defaults / autotune = {ratio}.\n\n" + markdown_table(cols, data["rows"]))
    print(md)
    write_result(out, "autotune_e2e", data, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
