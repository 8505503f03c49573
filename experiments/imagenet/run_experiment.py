"""Dense FP32 vs FP16 vs CSC on real handwritten digits, 2 CPU ranks: accuracy and wire bytes.

    # `make experiment`: 5 settings x 3 seeds, ~25 min
    python experiments/imagenet/run_experiment.py
    # `make demo`: CSC 1%, one seed, 6 epochs, ~2-3 min
    python experiments/imagenet/run_experiment.py --demo
    # a quick look
    python experiments/imagenet/run_experiment.py --settings dense csc-1% --seeds 0 --epochs 2

Every run is `torchrun --standalone --nproc-per-node 2 train.py ...` with the same seed, schedule
and data order; only the gradient communication differs. The per-epoch JSON lines of every run are
gathered into OUT/results.md (a table), OUT/summary.json and the plots OUT/top1.png, OUT/loss.png,
OUT/bytes.png.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from prepare import DEFAULT_OUT as DIGITS, prepare  # noqa: E402
from sweep import DIGITS_RECIPE as RECIPE, launch  # noqa: E402

# The only thing that differs between settings: how gradients cross the wire. CSC sends FP16
# values (the paper's mixed-precision wire) after a short dense warm-up in steps (DGC's first three
# stages, 25%, 6.25%, 1.56%, three steps each): one epoch is only 22 steps here, and DGC's
# per-epoch warm-up would spend a quarter of this short run at high density.
CSC = [
    "--compression",
    "csc",
    "--wire-dtype",
    "fp16",
    "--warmup",
    "3",
    "--warmup-unit",
    "step",
    "--warmup-period",
    "3",
]
SETTINGS = {
    "dense": ("dense FP32", ["--compression", "none"]),
    "fp16": ("FP16", ["--compression", "fp16", "--wire-dtype", "fp16"]),
    # Error feedback alone: the optimizer keeps its momentum.
    "csc-10%": ("CSC 10%", CSC + ["--density", "0.1", "--no-momentum-correction"]),
    "csc-1%": ("CSC 1%", CSC + ["--density", "0.01", "--no-momentum-correction"]),
    "csc-0.1%": ("CSC 0.1%", CSC + ["--density", "0.001", "--no-momentum-correction"]),
    # DGC's momentum correction: the compressor accumulates velocity (SGD's momentum moves into
    # it), so what waits in the residual is the momentum-corrected update, not the raw gradient.
    "csc-1%-mc": ("CSC 1% + MC", CSC + ["--density", "0.01", "--momentum-correction"]),
    # The library's default recipe, nothing else set.
    "csc-default": ("CSC 1% default", ["--compression", "csc", "--density", "0.01"]),
}

# One schedule for every setting (RECIPE, shared with the sweep): ResNet-18 (torchvision,
# unchanged) on 32x32 upscaled digits, global batch 64 (32 per rank), SGD momentum 0.9, cosine LR
# from 0.05 after a one-epoch warm-up.


def run_one(
    key: str, seed: int, epochs: int, out: Path, nproc: int, backend: str, timeout: float
) -> Path:
    """Train one (setting, seed) and return its JSON-lines log."""
    log = out / "logs" / f"{key}-seed{seed}.jsonl"
    args = [str(DIGITS), *RECIPE, *SETTINGS[key][1], "--epochs", str(epochs), "--seed", str(seed),
            "--dist-backend", backend]
    t0 = time.perf_counter()
    try:
        launch(args, log, out / "logs" / f"{key}-seed{seed}.out", nproc, timeout)
    except RuntimeError as exc:
        raise RuntimeError(f"run {key} seed {seed} failed ({exc})") from None
    print(f"  {SETTINGS[key][0]:<12} seed {seed}: {time.perf_counter() - t0:5.1f} s, "
          f"top-1 {read_log(log)[-1]['val_top1']:.2f}", flush=True)
    return log


def read_log(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def backend_of(out: Path, key: str, seeds: list) -> str:
    """The transport the runs of a setting used, read back from their console output."""
    found = set()
    for seed in seeds:
        path = out / "logs" / f"{key}-seed{seed}.out"
        m = re.search(r"dist_backend=(\w+)", path.read_text()) if path.exists() else None
        found.add(m.group(1) if m else "?")
    return "/".join(sorted(found))


def summarise(runs: dict, backends: dict | None = None) -> dict:
    """Per setting: final top-1 over seeds, steady and whole-run wire bytes per step, images/s."""
    summary = {}
    for key, logs in runs.items():
        finals = [log[-1]["val_top1"] for log in logs]
        steady = statistics.median(log[-1]["wire_bytes_per_step"] for log in logs)
        dense = statistics.median(log[-1]["dense_bytes_per_step"] for log in logs)
        whole = statistics.median(
            sum(r["wire_bytes"] for r in log) / sum(r["steps"] for r in log) for log in logs
        )
        # images/s from epoch 1 on: epoch 0 pays for compilation and first-touch allocation.
        ips = statistics.median(r["images_per_s"] for log in logs for r in (log[1:] or log))
        summary[key] = {
            "label": SETTINGS[key][0],
            "seeds": len(logs),
            "backend": (backends or {}).get(key, "?"),
            "top1_mean": statistics.mean(finals),
            "top1_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "top1_min": min(finals),
            "top1_max": max(finals),
            "top5_mean": statistics.mean(log[-1]["val_top5"] for log in logs),
            "wire_bytes_per_step_steady": steady,
            "wire_bytes_per_step_run": whole,
            "dense_bytes_per_step": dense,
            "images_per_s": ips,
            "comm_s_per_epoch": statistics.median(r["comm_s"] for log in logs for r in log),
            "density_final": logs[0][-1].get("density"),
            "per_epoch": {
                m: [statistics.mean(log[e][m] for log in logs) for e in range(len(logs[0]))]
                for m in ("val_top1", "train_loss", "val_loss", "wire_bytes_per_step")
            },
        }
    return summary


def markdown(
    summary: dict, epochs: int, seeds: list, nproc: int, backend: str, command: str
) -> str:
    dense_top1 = summary.get("dense", {}).get("top1_mean")
    lines = [
        f"## Digits (scikit-learn, 1437 train / 360 val), ResNet-18 at 32x32, {nproc} CPU ranks",
        "",
        f"{epochs} epochs, seeds {', '.join(map(str, seeds))}; "
        f"final top-1 as mean ± standard deviation over seeds "
        f"(min-max); wire bytes are what one rank hands to allreduce per step "
        f"(values and chunk norms); "
        f"'steady' is the last epoch, 'run' the whole-run average with the warm-up. "
        f"One val image = 0.28 points.",
        "",
        "| setting | top-1 (%) | Δ vs dense | top-5 (%) | wire bytes/step steady | run avg "
        "| fewer bytes (steady / run) | images/s | comm s/epoch | transport |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary.values():
        delta = f"{s['top1_mean'] - dense_top1:+.2f}" if dense_top1 is not None else "n/a"
        lines.append(
            f"| {s['label']} | {s['top1_mean']:.2f} ± {s['top1_std']:.2f} "
            f"({s['top1_min']:.2f}-{s['top1_max']:.2f}) "
            f"| {delta} | {s['top5_mean']:.2f} | {_bytes(s['wire_bytes_per_step_steady'])} | "
            f"{_bytes(s['wire_bytes_per_step_run'])} | "
            f"{s['dense_bytes_per_step'] / max(s['wire_bytes_per_step_steady'], 1):.0f}x / "
            f"{s['dense_bytes_per_step'] / max(s['wire_bytes_per_step_run'], 1):.0f}x | "
            f"{s['images_per_s']:.0f} | {s['comm_s_per_epoch']:.2f} | {s['backend']} |"
        )
    lines += ["", f"Command: `{command}`", ""]
    return "\n".join(lines)


def _bytes(n: float) -> str:
    return f"{n / 1e6:.3f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def plot(runs: dict, summary: dict, out: Path) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for metric, ylabel, fname, logy in (
        ("val_top1", "val top-1 (%)", "top1.png", False),
        ("train_loss", "train loss", "loss.png", True),
        ("wire_bytes_per_step", "wire bytes per step (one rank)", "bytes.png", True),
    ):
        zoom = (
            metric == "val_top1"
        )  # a second panel on the last half: the differences are a point or two
        fig, axes = plt.subplots(
            1, 2 if zoom else 1, figsize=(10.5 if zoom else 6.4, 4.0), squeeze=False
        )
        for ax in axes[0]:
            for key, logs in runs.items():
                epochs = [r["epoch"] for r in logs[0]]
                values = [[log[e][metric] for log in logs] for e in range(len(epochs))]
                if ax is axes[0][-1] and zoom:
                    epochs, values = epochs[len(epochs) // 2:], values[len(values) // 2:]
                mean = [statistics.mean(v) for v in values]
                line, = ax.plot(epochs, mean, marker="o", ms=3, label=summary[key]["label"])
                if len(logs) > 1:
                    ax.fill_between(epochs, [min(v) for v in values], [max(v) for v in values],
                                    color=line.get_color(), alpha=0.15, lw=0)
            ax.set_xlabel("epoch")
            ax.set_ylabel(ylabel)
            if logy:
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        axes[0][0].set_title(f"{ylabel}: mean over seeds, band = min-max", fontsize=9)
        if zoom:
            axes[0][1].set_title("second half of training, zoomed", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        written.append(out / fname)
    return written


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a.split("=")[0] in ("--densities", "--chunk-sizes") for a in argv):
        import sweep  # the density x chunk-size grid (issue: tuning the sparsity)

        return sweep.main(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--demo",
        action="store_true",
        help="short version: CSC 1%% (momentum correction), one seed, 6 epochs",
    )
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=None)
    p.add_argument("--seeds", nargs="+", type=int, default=None)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--nproc", type=int, default=2, help="ranks (CPU processes)")
    p.add_argument("--dist-backend", default="gradientflow")
    p.add_argument("--out", type=Path, default=None, help="results folder")
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed per run")
    p.add_argument(
        "--no-run", action="store_true", help="only rebuild the table and plots from OUT/logs"
    )
    args = p.parse_args(argv)
    settings = args.settings or (["csc-1%-mc"] if args.demo else list(SETTINGS))
    seeds = args.seeds or ([0] if args.demo else [0, 1, 2])
    epochs = args.epochs or (6 if args.demo else 8)
    out = args.out or (HERE / "runs" / "demo" if args.demo else HERE / "results")
    out.mkdir(parents=True, exist_ok=True)
    command = "python experiments/imagenet/run_experiment.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )

    prepare()
    t0 = time.perf_counter()
    print(
        f"{len(settings)} settings x {len(seeds)} seeds, {epochs} epochs each, "
        f"{args.nproc} ranks -> {out}",
        flush=True,
    )
    runs = {}
    try:
        for key in settings:
            runs[key] = [
                read_log(out / "logs" / f"{key}-seed{s}.jsonl")
                if args.no_run
                else read_log(
                    run_one(key, s, epochs, out, args.nproc, args.dist_backend, args.timeout)
                )
                for s in seeds
            ]
    except RuntimeError as exc:
        print(f"run_experiment.py: error: {exc}; logs in {out / 'logs'}", file=sys.stderr)
        return 1
    summary = summarise(runs, {key: backend_of(out, key, seeds) for key in runs})
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    table = markdown(summary, epochs, seeds, args.nproc, args.dist_backend, command.strip())
    (out / "results.md").write_text(table)
    plots = plot(runs, summary, out)
    print(table)
    print_verdict(summary, time.perf_counter() - t0, out, plots, epochs, seeds, args.nproc)
    return 0


def print_verdict(
    summary: dict, elapsed: float, out: Path, plots: list, epochs: int, seeds: list, nproc: int
) -> None:
    """The at-a-glance ending: accuracy, speed, bytes, where things are."""
    print(
        f"\n=== GradientFlow on real handwritten digits: ResNet-18, {nproc} CPU ranks, "
        f"{epochs} epochs, "
        f"{len(seeds)} seed(s), {elapsed / 60:.1f} min ==="
    )
    print(
        "  (top-1 on 360 held-out images; "
        "bytes = what each rank sends per step once warm-up is over)"
    )
    for s in summary.values():
        ratio = s["dense_bytes_per_step"] / max(s["wire_bytes_per_step_steady"], 1)
        print(
            f"  {s['label']:<12} top-1 {s['top1_mean']:6.2f}%  {s['images_per_s']:5.0f} images/s  "
            f"sent {_bytes(s['wire_bytes_per_step_steady'])}/step "
            f"vs {_bytes(s['dense_bytes_per_step'])} dense "
            f"({ratio:.0f}x fewer)"
        )
    print(f"Table:  {out / 'results.md'}")
    print(f"Plots:  {', '.join(str(p) for p in plots)}")
    print(f"Logs:   {out / 'logs'} (one JSON line per epoch per run)")


if __name__ == "__main__":
    sys.exit(main())
