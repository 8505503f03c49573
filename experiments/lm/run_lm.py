"""The transformer stage: `make lm`. DDP, CSC 1% and torch's FP16 hook, 3 seeds, 2 ranks on the
gradientflow backend over loopback; then results.md with the validation loss curves, the final
validation and test loss and perplexity, and the paired difference to DDP.

    python experiments/lm/run_lm.py                       # 3 settings x seeds 11-13, 2000 steps
    python experiments/lm/run_lm.py --jobs 2              # two runs at a time
    python experiments/lm/run_lm.py --no-run              # the report from the logs
    python experiments/lm/run_lm.py --smoke               # 300 steps, seed 10, DDP and CSC

Runs go seed by seed (every setting at one seed before the next); a run whose log is complete
(its last line has the test evaluation) and whose arguments match is kept.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE.parent / "imagenet"))
import protocol  # noqa: E402
import provenance  # noqa: E402
from converge_report import paired_interval  # noqa: E402

LABELS = {"ddp": "DDP (dense FP32 allreduce)", "csc": "GradientFlow CSC 1% (default recipe)",
          "torch-fp16": "DDP + torch fp16_compress_hook"}
GOAL_PCT = 1.0  # CSC's final validation loss within this many percent of DDP's


def read_log(path: Path) -> list:
    """The JSON lines of a run (a torn last line ignored)."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def run_one(out: Path, setting: str, seed: int, steps: int, extra: list, timeout: float) -> None:
    """One torchrun of train_lm.py; its log and a meta file with what it cost."""
    stem = out / "logs" / f"{setting}-seed{seed}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    log = stem.with_suffix(".jsonl")
    log.unlink(missing_ok=True)
    args = ["--setting", setting, "--steps", str(steps), "--seed", str(seed), *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(HERE / "train_lm.py"), *args, "--json-log", str(log)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    started, load, commit = provenance.utc_now(), os.getloadavg(), provenance.commit()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{setting} seed {seed}: timed out after {timeout:.0f} s") from None
    stem.with_suffix(".out").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        lines = (proc.stdout + proc.stderr).strip().splitlines() or ["no output"]
        raise RuntimeError(f"{setting} seed {seed}: exit {proc.returncode}: {lines[-1]}")
    meta = {"setting": setting, "seed": seed, "args": args, "started_utc": started,
            "ended_utc": provenance.utc_now(), "wall_s": round(time.perf_counter() - t0, 1),
            "loadavg_before": load, "loadavg_after": os.getloadavg(),
            "commit": commit, "host": provenance.host(),
            **provenance.run_fields(read_log(log))}
    stem.with_suffix(".meta.json").write_text(json.dumps(meta) + "\n")
    print(f"  {setting} seed {seed}: {meta['wall_s']:.0f} s, val loss "
          f"{read_log(log)[-1]['val_loss']:.4f}", flush=True)


def done(out: Path, setting: str, seed: int, steps: int, extra: list) -> bool:
    """Whether the run has a complete log made with the same arguments."""
    log = read_log(out / "logs" / f"{setting}-seed{seed}.jsonl")
    meta = out / "logs" / f"{setting}-seed{seed}.meta.json"
    want = ["--setting", setting, "--steps", str(steps), "--seed", str(seed), *extra]
    return (bool(log) and "test_loss" in log[-1] and meta.exists()
            and json.loads(meta.read_text()).get("args") == want)


def label(key: str, extra: list) -> str:
    """A setting's name in the table, with the density and options --train-args give CSC."""
    if key != "csc":
        return LABELS[key]
    density = float(extra[extra.index("--density") + 1]) if "--density" in extra else 0.01
    options = [extra[i + 1] for i, a in enumerate(extra[:-1]) if a == "--csc-option"]
    return (f"GradientFlow CSC {100 * density:g}% "
            f"({', '.join(options) if options else 'default recipe'})")


def summarise(out: Path, settings: list, seeds: list, extra: list = ()) -> dict:
    """{setting: row} of the finished runs: final losses per seed, curves, cost."""
    extra, rows = list(extra), {}
    for key in settings:
        logs = {s: read_log(out / "logs" / f"{key}-seed{s}.jsonl") for s in seeds}
        logs = {s: log for s, log in logs.items() if log and "test_loss" in log[-1]}
        if not logs:
            continue
        metas = {s: json.loads((out / "logs" / f"{key}-seed{s}.meta.json").read_text())
                 for s in logs}
        steps = [r["step"] for r in next(iter(logs.values()))]
        rows[key] = {
            "label": label(key, extra),
            "val_loss": {s: log[-1]["val_loss"] for s, log in logs.items()},
            "test_loss": {s: log[-1]["test_loss"] for s, log in logs.items()},
            "curve": {st: statistics.mean(log[i]["val_loss"] for log in logs.values())
                      for i, st in enumerate(steps)},
            "bytes_ratio": statistics.mean(log[-1]["dense_bytes"] / log[-1]["wire_bytes"]
                                           for log in logs.values() if log[-1].get("wire_bytes")),
            "wall_s": {s: m["wall_s"] for s, m in metas.items()},
            "cpu_s": {s: m.get("cpu_s") for s, m in metas.items()},
            "commits": sorted({m.get("commit", "?") for m in metas.values()}),
        }
    base = rows.get("ddp")
    for key, row in rows.items():
        rel = ({s: 100 * v / base["val_loss"][s] - 100 for s, v in row["val_loss"].items()
                if s in base["val_loss"]} if base and key != "ddp" else {})
        row["vs_ddp_pct"] = paired_interval(rel, {s: 0.0 for s in rel}) if rel else None
        row["vs_ddp_pct_seeds"] = rel
    return rows


def _ms(values) -> str:
    v = list(values)
    return f"{statistics.mean(v):.4f}" + (f" ± {statistics.stdev(v):.4f}" if len(v) > 1 else "")


def markdown(rows: dict, seeds: list, steps: int, title: str, command: str) -> str:
    lines = [f"# {title}", "",
             f"Byte-level GPT on the Jargon File (experiments/lm/README.md), AdamW, warm-up + "
             f"cosine over {steps} steps, 2 CPU ranks on the gradientflow backend over loopback, "
             f"seeds {', '.join(map(str, seeds))}. Losses are mean next-byte cross-entropy "
             f"(nats); perplexity is exp(loss), per byte. Validation: the corpus's 90-95% part, "
             f"scored during training; test: its last 5%, read once after the last step. "
             f"Difference to DDP: the final validation loss's excess over DDP's, in percent, "
             f"paired by seed, with its 95% Student t interval where there are two seeds or more.",
             "", "| setting | seeds run | final val loss | val perplexity | test loss | "
             "test perplexity | vs DDP (val, %) | fewer bytes | wall min/run | CPU min/run | "
             "commits |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in rows.items():
        iv, rel = r["vs_ddp_pct"], r["vs_ddp_pct_seeds"]
        vs = ("-" if not rel else f"{statistics.mean(rel.values()):+.2f}"
              + (f" [{iv['low']:+.2f}, {iv['high']:+.2f}]" if iv else " (one seed)"))
        cpu = [c for c in r["cpu_s"].values() if c]
        lines.append(
            f"| {r['label']} | {', '.join(map(str, r['val_loss']))} | "
            f"{_ms(r['val_loss'].values())} | "
            f"{statistics.mean(math.exp(v) for v in r['val_loss'].values()):.3f} | "
            f"{_ms(r['test_loss'].values())} | "
            f"{statistics.mean(math.exp(v) for v in r['test_loss'].values()):.3f} | {vs} | "
            f"{r['bytes_ratio']:.1f}x | {statistics.mean(r['wall_s'].values()) / 60:.1f} | "
            + (f"{statistics.mean(cpu) / 60:.1f}" if cpu else "-")
            + f" | {', '.join(r['commits'])} |")
    if "csc" in rows and rows["csc"]["vs_ddp_pct_seeds"]:
        gap = statistics.mean(rows["csc"]["vs_ddp_pct_seeds"].values())
        lines += ["", f"Goal, CSC's final validation loss within {GOAL_PCT:g}% of DDP's: "
                  f"**{'met' if abs(gap) <= GOAL_PCT else 'missed'}** ({gap:+.2f}%)."]
    if rows:
        marks = list(next(iter(rows.values()))["curve"])
        lines += ["", "Validation loss by step (mean over seeds):", "",
                  "| step | " + " | ".join(r["label"] for r in rows.values()) + " |",
                  "|---|" + "---|" * len(rows)]
        for st in marks:
            lines.append(f"| {st} | " + " | ".join(f"{r['curve'].get(st, float('nan')):.4f}"
                                                   for r in rows.values()) + " |")
    lines += ["", f"Command: `{command}`", ""]
    return "\n".join(lines)


def plot(rows: dict, path: Path) -> None:
    """Validation loss against step, one line per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for r in rows.values():
        ax.plot(list(r["curve"]), list(r["curve"].values()), marker="o", ms=3, label=r["label"])
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats per byte)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", nargs="+", choices=list(LABELS), default=list(LABELS))
    # Seeds 11-13: the AdamW screen (README, "CSC with AdamW") ran on seed 10, so a report of
    # that choice must not include it.
    p.add_argument("--seeds", nargs="+", type=int, default=list(protocol.REPORT_SEEDS[1:4]))
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--timeout", type=float, default=6 * 3600, help="seconds allowed per run")
    p.add_argument("--train-args", default="", help="more train_lm.py flags for every run")
    p.add_argument("--out", type=Path, default=None, help="default: experiments/lm/results")
    p.add_argument("--smoke", action="store_true",
                   help="300 steps, seed 10, DDP and CSC, into results/smoke (not the result)")
    p.add_argument("--no-run", action="store_true")
    p.add_argument("--title", default=None, help="the report's title (default: the stage's; "
                   "--smoke: a smoke run's)")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.seeds, args.settings = 300, args.seeds[:1], ["ddp", "csc"]
    out = args.out or HERE / "results" / ("smoke" if args.smoke else "")
    extra = shlex.split(args.train_args)
    title = args.title or (
        "SMOKE RUN, not the result: the transformer stage's machinery at 300 steps, one seed"
        if args.smoke else "A transformer with AdamW: DDP, CSC 1% and torch's FP16 hook")
    command = "python experiments/lm/run_lm.py " + " ".join(map(shlex.quote, argv))
    failures = []
    if not args.no_run:
        sys.path.insert(0, str(HERE))
        import corpus

        try:
            corpus.ensure()
        except corpus.CorpusUnavailable as exc:
            print(f"run_lm.py: error: {exc}", file=sys.stderr)
            return 2
        todo = [(k, s) for s in args.seeds for k in args.settings
                if not done(out, k, s, args.steps, extra)]
        print(f"{len(todo)} run(s) to go, {args.jobs} at a time -> {out}", flush=True)

        def one(job):
            try:
                run_one(out, *job, args.steps, extra, args.timeout)
            except RuntimeError as exc:
                failures.append(str(exc))
                print(f"  {exc}", file=sys.stderr, flush=True)

        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            list(pool.map(one, todo))
    rows = summarise(out, args.settings, args.seeds, extra)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(rows, args.seeds, args.steps, title, command.strip())
    (out / "results.md").write_text(text)
    (out / "summary.json").write_text(json.dumps(rows, indent=1, default=str) + "\n")
    if rows:
        plot(rows, out / "val_loss.png")
    print(text)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
