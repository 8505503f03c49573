"""Tables and plots of the cost model: configurations, calibration, reproductions.

matplotlib is optional (the `experiments` extra): without it the markdown and JSON are still
written and the plots are listed as skipped.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from gradientflow.simulate.cluster import Cluster
from gradientflow.simulate.cluster import preset as method_preset
from gradientflow.simulate.collectives import algorithm_bandwidth
from gradientflow.simulate.models import MODELS, load
from gradientflow.simulate.reproduce import PAPER, RS, run_all, sensitivity
from gradientflow.simulate.step import simulate

GPU_COUNTS = (1, 8, 16, 32, 64, 128, 256, 512, 1024)
METHODS = ("gradientflow", "gradientflow-paper", "ring", "horovod", "hierarchical",
           "reduction_server")


def sweep(model: str, cluster: Cluster = PAPER, methods=METHODS, gpus=GPU_COUNTS) -> list[dict]:
    """Speedup and friends of every method at every GPU count on one cluster."""
    rows = []
    m = load(model)
    for name in methods:
        for n in gpus:
            r = simulate(m, cluster.with_gpus(n), method_preset(name))
            rows.append({"model": model, "method": name, "gpus": n, "speedup": r.speedup,
                         "efficiency": r.scaling_efficiency, "step_ms": 1e3 * r.step_s,
                         "exposed_ms": 1e3 * r.exposed_comm_s, "epoch_s": r.epoch_time_s,
                         "wire_MB": r.wire_bytes / 1e6, "messages": r.messages})
    return rows


def table(header: list[str], rows: list[list]) -> str:
    """A markdown table; floats to 3 significant digits."""
    def cell(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def _plot_speedup(rows: list[dict], model: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for name in METHODS:
        pts = [(r["gpus"], r["speedup"]) for r in rows if r["method"] == name]
        ax.plot(*zip(*pts), marker="o", ms=3, label=name)
    ax.plot(GPU_COUNTS, GPU_COUNTS, "k:", lw=1, label="linear")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("GPUs (8 per node)")
    ax.set_ylabel("speedup over one GPU")
    ax.set_title(f"{model}: predicted speedup, 56 Gbps between nodes")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_algbw(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [2**k for k in range(12, 32)]
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for name in ("ring", "hierarchical", "reduction_server"):
        ax.plot(sizes, [algorithm_bandwidth(RS, method_preset(name), s) for s in sizes],
                marker="o", ms=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("allreduce payload per GPU (bytes)")
    ax.set_ylabel("algorithm bandwidth (Gbit/s)")
    ax.set_title("8 nodes x 8 GPUs, 100 Gbps per node")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_calibration(cal: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    for key, label, mk in (("fit_rows", "fitted (2 ranks)", "o"),
                           ("holdout_rows", "held out (4 ranks)", "x")):
        xs = [e["measured_ms"] for e in cal[key]]
        ys = [e["predicted_ms"] for e in cal[key]]
        ax.scatter(xs, ys, marker=mk, s=14, label=label)
    lim = [0, max(e["measured_ms"] for k in ("fit_rows", "holdout_rows") for e in cal[k]) * 1.05]
    ax.plot(lim, lim, "k:", lw=1)
    ax.plot(lim, [v * 1.15 for v in lim], "k:", lw=0.5)
    ax.plot(lim, [v * 0.85 for v in lim], "k:", lw=0.5)
    ax.set_xlabel("measured step (ms)")
    ax.set_ylabel("predicted step (ms)")
    ax.set_title("calibration: emulated switch, 1-10 Gbps")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _spread(errs: list[dict], variant: str) -> float:
    """Largest over smallest measured step of one variant's launches, minus 1."""
    ms = [e["measured_ms"] for e in errs if e["variant"] == variant] or [1.0]
    return max(ms) / min(ms) - 1


def _per_variant(errs: list[dict]) -> list[list]:
    out = []
    for v in sorted({e["variant"] for e in errs}):
        es = [e for e in errs if e["variant"] == v]
        out.append([v, len(es), f"{100 * statistics.median(e['step_err'] for e in es):+.1f}%",
                    f"{100 * statistics.median(abs(e['step_err']) for e in es):.1f}%",
                    statistics.median(e["comm_measured_ms"] for e in es),
                    statistics.median(e["comm_predicted_ms"] for e in es)])
    return out


def write_report(out: Path, calibration: dict | None = None, quick: bool = False) -> dict:
    """Write simulate.md, simulate.json and the PNGs under `out`; return the JSON."""
    out.mkdir(parents=True, exist_ok=True)
    models = ("resnet50",) if quick else MODELS
    sweeps = {m: sweep(m) for m in models}
    reps, sens = run_all(), sensitivity()
    result = {"name": "simulate", "reproductions": reps, "sensitivity": sens, "sweeps": sweeps,
              "plots": [], "skipped_plots": []}
    if calibration is not None:
        result["calibration"] = {k: calibration[k] for k in ("constants", "fit", "holdout", "new")
                                 if k in calibration}
    md = ["## Scale-out cost model (`gradientflow.simulate`)", "",
          "Predictions, not measurements: see docs/SIMULATE.md for the model, its assumptions "
          "and where it is wrong. Regenerate with `python benchmarks/bench_simulate.py`.", "",
          "### Reproductions (each within 15% of the paper's number?)", "",
          table(["claim", "paper", "predicted", "error", "within 15%"],
                [[r["claim"], f"{r['target']:g} {r['unit']}",
                  f"{r['predicted']:.3g} {r['unit']}", f"{100 * r['error']:+.1f}%",
                  "yes" if r["ok"] else "NO"] for r in reps]), "",
          "### Sensitivity: one assumption changed at a time", "",
          table(["change", "reproduction", "at the stated assumptions", "changed", "error"],
                [[s["change"], s["key"], s["baseline"], s["predicted"],
                  f"{100 * s['error']:+.1f}%"] for s in sens]), ""]
    if calibration is not None:
        c = calibration
        md += ["### Calibration on the emulated switch", "",
               "Fitted on the 2-rank runs of benchmarks/results/e2e/e2e.json (plus the 64 MiB tier "
               "probes and the 2-rank small allreduces of collectives.json); error stated on the "
               "4-rank runs (e2e_4ranks*), which the fit never saw. Step error = predicted / "
               "measured - 1; communication = step minus the launch's no-communication step.", "",
               table(["constant", "value"], [[k, v] for k, v in c["constants"].items()]), "",
               table(["set", "rows", "median abs step err", "p90", "max",
                      "median abs comm err ms", "median measured comm ms"],
                     [[name, s["rows"], f"{100 * s['median_abs_step_err']:.1f}%",
                       f"{100 * s['p90_abs_step_err']:.1f}%",
                       f"{100 * s['max_abs_step_err']:.1f}%", s["median_abs_comm_err_ms"],
                       s["median_comm_measured_ms"]]
                      for name, s in (("fitted", c["fit"]), ("held out", c["holdout"]))]), "",
               *([f"A new run made for this check (ResNet-50, 3 ranks, 2.5 Gbps, "
                  f"benchmarks/results/simulate/e2e_3ranks_loaded) at a load of 24-27 from other "
                  f"jobs on 2 cores: {c['new']['rows']} rows, median abs step error "
                  f"{100 * c['new']['median_abs_step_err']:.1f}%, max "
                  f"{100 * c['new']['max_abs_step_err']:.1f}%; its DDP launches differ by "
                  f"{100 * _spread(c['new_rows'], 'ddp'):.0f}% from each other, so it measures "
                  f"the load as much as the network.", ""]
                 if "new" in c else []),
               "Held-out error per variant (median over tiers, models and launches):", "",
               table(["variant", "rows", "median step err", "median abs step err",
                      "measured comm ms", "predicted comm ms"], _per_variant(c["holdout_rows"])),
               "",
               "Probes (collectives alone): " + "; ".join(
                   f"{p['ranks']} ranks {p['what']}: {p['ms']:.3g} ms measured, "
                   f"{p['predicted_ms']:.3g} predicted"
                   for p in c["probes"] + c["holdout_probes"]) + ".", ""]
    for m, rows in sweeps.items():
        md += [f"### {m}: predicted speedup over one GPU (56 Gbps, 8 GPUs per node, "
               f"batch {load(m).batch} per GPU)", "",
               table(["method"] + [str(n) for n in GPU_COUNTS],
                     [[name] + [r["speedup"] for r in rows if r["method"] == name]
                      for name in METHODS]), ""]
        at = [r for r in rows if r["gpus"] == 512]
        md += ["At 512 GPUs: " + "; ".join(
            f"{r['method']} {r['step_ms']:.3g} ms/step, {r['exposed_ms']:.3g} ms exposed, "
            f"{r['messages']} messages, {r['wire_MB']:.3g} MB sent per GPU, epoch "
            f"{r['epoch_s']:.3g} s" for r in at) + ".", ""]
    try:
        for m, rows in sweeps.items():
            name = f"simulate_speedup_{m}.png"
            _plot_speedup(rows, m, out / name)
            result["plots"].append(name)
        _plot_algbw(out / "simulate_algbw.png")
        result["plots"].append("simulate_algbw.png")
        if calibration is not None:
            _plot_calibration(calibration, out / "simulate_calibration.png")
            result["plots"].append("simulate_calibration.png")
    except ImportError:
        result["skipped_plots"].append("matplotlib is not installed (pip install .[experiments])")
    md += [f"![{p}]({p})" for p in result["plots"]]
    md += [f"Plots skipped: {s}" for s in result["skipped_plots"]]
    (out / "simulate.md").write_text("\n".join(md) + "\n")
    (out / "simulate.json").write_text(json.dumps(result, indent=1))
    return result
