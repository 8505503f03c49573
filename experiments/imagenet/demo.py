"""`make demo`: GradientFlow beside DDP on Fashion-MNIST, accuracy against time and bytes.

    python experiments/imagenet/demo.py             # about 2 minutes on 2 idle cores
    python experiments/imagenet/demo.py --link-gbps 10 --steps 200

The same AlexNet-shaped model (models.py), data, seed and plain SGD recipe twice, 2 CPU ranks:
DDP on gloo, then GradientFlow's CSC with its default recipe (`--compression csc --density
0.01`), 3 evaluations on the 10,000 test images, each after --steps steps (a quarter of an
epoch by default). As root the ranks run on an emulated switch of --link-gbps (a network
namespace per rank, tbf both ways: benchmarks/netem.py). Without root there is no switch: the
ranks run on loopback and the link is modelled, each step's time being the measured one plus
what a ring allreduce of its measured bytes takes on the link (2(n-1)/n x bytes x 8 / rate,
no overlap with backward). Prints a table and writes one plot, both lines on each panel.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import run_experiment as rx  # noqa: E402
from prepare import DataUnavailable  # noqa: E402
from sweep import read_log  # noqa: E402

PAIR = ("ddp-gloo", rx.OURS)
NAMES = {"ddp-gloo": "DDP (gloo)", rx.OURS: "GradientFlow CSC 1%"}


def modelled_times(log: list, link_gbps: float, nproc: int) -> list:
    """Cumulative training time per evaluation on a modelled link: the measured time plus a
    ring allreduce of the measured bytes (what loopback did not cost)."""
    ring = 2 * (nproc - 1) / nproc
    total, out = 0.0, []
    for r in log:
        total += r["train_time_s"] + ring * r["wire_bytes"] * 8 / (link_gbps * 1e9)
        out.append(total)
    return out


def curve(log: list, shaped: bool, link_gbps: float, nproc: int) -> dict:
    """Time (s), bytes sent (MB, one rank) and top-1 after each evaluation."""
    if shaped:
        times, t = [], 0.0
        for r in log:
            t += r["train_time_s"]
            times.append(t)
    else:
        times = modelled_times(log, link_gbps, nproc)
    sent, total = [], 0.0
    for r in log:
        total += (r.get("nic_tx_bytes") or r["wire_bytes"]) / 1e6
        sent.append(total)
    return {"time_s": times, "sent_mb": sent, "top1": [r["val_top1"] for r in log]}


def time_sentence(ddp_s: float, ours_s: float) -> str:
    """How GradientFlow's training time compares with DDP's, said the way round it went:
    "1.7x less training time", or "1.25x more training time" (never "0.8x less")."""
    if ours_s <= ddp_s:
        return f"{ddp_s / ours_s:.1f}x less training time"
    return f"{ours_s / ddp_s:.2f}x more training time"


def plot(curves: dict, path: Path, link: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for key, c in curves.items():
        style = dict(color="black", lw=2.5) if key == rx.OURS else dict(color="tab:blue", lw=1.5)
        a.plot([0] + c["time_s"], [10.0] + c["top1"], marker="o", label=NAMES[key], **style)
        b.plot([0] + c["sent_mb"], [10.0] + c["top1"], marker="o", label=NAMES[key], **style)
    a.set_xlabel(f"training time (s), {link}")
    b.set_xlabel("MB sent by one rank (log)")
    b.set_xscale("symlog", linthresh=1.0)
    for ax in (a, b):
        ax.set_ylabel("Fashion-MNIST test top-1 (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Same model, data and seed: DDP and GradientFlow", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link-gbps", type=rx.positive, default=1.0)
    p.add_argument("--steps", type=int, default=120, help="steps between evaluations")
    p.add_argument("--evals", type=int, default=3, help="evaluations (train.py epochs)")
    p.add_argument("--out", type=Path, default=HERE / "runs" / "demo-fashion")
    args = p.parse_args(argv)
    shaped = os.geteuid() == 0
    link = f"{args.link_gbps:g} Gbit/s " + ("emulated switch" if shaped else "modelled link")
    try:
        common = rx.data_args("fashion-mnist", "alexnet_shaped", "plain") + [
            "--steps-per-epoch", str(args.steps)]
    except DataUnavailable as exc:
        print(f"demo.py: error: {exc}", file=sys.stderr)
        return 2
    if shaped:
        print(f"Link: an emulated {args.link_gbps:g} Gbit/s switch (one network namespace per "
              f"rank, tbf both ways).")
    else:
        print(f"Link: not root, so no emulated switch: the ranks run on loopback and a "
              f"{args.link_gbps:g} Gbit/s link is modelled (each step's measured time plus a "
              f"ring allreduce of its measured bytes at that rate, no overlap).")
    t0, curves = time.perf_counter(), {}
    for key in PAIR:
        try:
            log_path = rx.run_one(key, 0, args.evals, args.out, 2, "gradientflow", 600,
                                  args.link_gbps if shaped else None, None, common)
        except RuntimeError as exc:
            print(f"demo.py: error: {exc}", file=sys.stderr)
            return 1
        curves[key] = curve(read_log(log_path), shaped, args.link_gbps, 2)
    print(f"\nAlexNet-shaped (2.75 M weights) on Fashion-MNIST, 2 CPU ranks, batch 128, "
          f"{link}:")
    print(f"{'':24}" + "".join(f"  eval {i} (time / MB / top-1)  " for i in range(args.evals)))
    for key, c in curves.items():
        cells = [f"{t:6.1f} s {mb:8.1f} MB {a:5.2f}%"
                 for t, mb, a in zip(c["time_s"], c["sent_mb"], c["top1"])]
        print(f"{NAMES[key]:<24}" + "  ".join(cells))
    d, g = curves["ddp-gloo"], curves[rx.OURS]
    print(f"\nGradientFlow: {time_sentence(d['time_s'][-1], g['time_s'][-1])}, "
          f"{d['sent_mb'][-1] / g['sent_mb'][-1]:.0f}x fewer bytes, top-1 "
          f"{g['top1'][-1] - d['top1'][-1]:+.2f} points against DDP after "
          f"{args.evals * args.steps} steps.")
    path = args.out / "demo.png"
    plot(curves, path, link)
    print(f"Plot: {path}  ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
