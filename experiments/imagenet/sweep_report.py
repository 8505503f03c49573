"""The sweep's outputs from its logs: table, Pareto plot, step-time model, recommendation.

Step time on a link (`predict_step_s`) is a bandwidth model, no overlap assumed:

    t(link) = t_compute + t_codec + rounds * 2(n-1) * latency + 2(n-1)/n * bytes * 8 / link

t_compute is the same for every setting (same model, batch and data): the dense runs' fastest
epoch's mean step time (forward, backward, optimiser and the dense transfer over loopback, so
an upper bound). t_codec is the setting's own CPU work, the engine's codec time per step
(median over epochs 1 and later; 0 for dense). Each setting's whole measured step is not used:
on a shared machine it moves by a third between epochs of one run, more than the settings
differ. bytes are the steady-state bytes one rank hands to allreduce per step, 2(n-1)/n the
share of them a ring allreduce moves over each rank's link, rounds the collective rounds per
step (1 dense or FP16, 2 for CSC: the chunk norms, then the chunks) and 2(n-1) the ring's steps
per round. Overlap with backward would hide part of the communication term, most of it for the
settings that send the most.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from sweep import BUILTIN_DATA_SUFFIX, log_paths, read_log


def collect(grid: list, seeds: list, out: Path, epochs: int) -> dict:
    """{setting: [per-epoch records of each finished seed]} for settings with a finished seed."""
    runs = {}
    for setting in grid:
        logs = []
        for seed in seeds:
            log, meta, _ = log_paths(out, setting, seed)
            records = read_log(log) if log.is_file() and meta.is_file() else []
            if [r.get("epoch") for r in records] == list(range(epochs)):
                logs.append(records)
        if logs:
            runs[setting] = logs
    return runs


def summarise(runs: dict) -> list:
    """One row per setting: final top-1 over seeds, bytes per step, speed."""
    rows = []
    for setting, logs in runs.items():
        finals = [log[-1]["val_top1"] for log in logs]
        later = [r for log in logs for r in (log[1:] or log)]  # epoch 0 pays for warm-up and JIT
        rows.append({
            "key": setting.key, "label": setting.label, "method": setting.method,
            "density": setting.density, "chunk_size": setting.chunk_size, "seeds": len(logs),
            "top1_mean": statistics.mean(finals),
            "top1_sd": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "top1_all": finals,
            # What the top-1 was scored on: a recommendation ranks validation splits only.
            "eval_set": ("validation" if all(log[-1].get("eval_set") == "validation"
                                             for log in logs) else "test"),
            "wire_bytes_per_step": _last_median(logs, "wire_bytes_per_step"),
            "wire_bytes_per_step_run": statistics.median(
                sum(r["wire_bytes"] for r in log) / sum(r["steps"] for r in log) for log in logs),
            "dense_bytes_per_step": _last_median(logs, "dense_bytes_per_step"),
            "images_per_s": statistics.median(r["images_per_s"] for r in later),
            "step_s": statistics.median(r["train_time_s"] / r["steps"] for r in later),
            # The fastest epoch: on a shared machine the least disturbed estimate of the step.
            "fastest_step_s": min(r["train_time_s"] / r["steps"] for r in later),
            "codec_s": statistics.median(
                r.get("engine", {}).get("codec_time_s", 0.0) / r["steps"] for r in later),
        })
    return rows


def _last_median(logs: list, field: str) -> float:
    """Median over seeds of a field's value in the last epoch (the steady state)."""
    return statistics.median(log[-1][field] for log in logs)


def compute_time(rows: list) -> float:
    """t_compute of the model: the dense runs' fastest epoch (else the least codec-free step)."""
    dense = [r["fastest_step_s"] for r in rows if r["method"] == "dense"]
    return min(dense) if dense else min(r["fastest_step_s"] - r["codec_s"] for r in rows)


def predict_step_s(row: dict, gbps: float, ranks: int, latency_us: float = 0.0,
                   compute_s: float | None = None) -> float:
    """Predicted step time of a setting on a `gbps` link with `ranks` ranks (module docstring).

    compute_s: t_compute, shared by every setting (compute_time(rows)); default the row's own
    fastest step less its codec time.
    """
    if compute_s is None:
        compute_s = row["fastest_step_s"] - row["codec_s"]
    rounds = 2 if row["method"] == "csc" else 1
    share = 2 * (ranks - 1) / ranks
    return (compute_s + row["codec_s"] + rounds * 2 * (ranks - 1) * latency_us * 1e-6
            + share * row["wire_bytes_per_step"] * 8 / (gbps * 1e9))


def recommend(rows: list, gbps: float, within_pct: float, ranks: int,
              latency_us: float = 0.0) -> dict:
    """The most accurate setting whose predicted step time is within `within_pct` of the fastest.

    Ties in accuracy go to the faster setting. Returns the choice, the fastest, and every
    setting's predicted time. A choice ranks validation splits only (protocol.py): where an
    eligible setting was scored on the test set the choice is None and "why" says so.
    """
    compute_s = compute_time(rows)
    times = {r["key"]: predict_step_s(r, gbps, ranks, latency_us, compute_s) for r in rows}
    fastest = min(rows, key=lambda r: times[r["key"]])
    limit = times[fastest["key"]] * (1 + within_pct / 100)
    eligible = [r for r in rows if times[r["key"]] <= limit]
    on_test = [r["label"] for r in eligible if r.get("eval_set") != "validation"]
    if on_test:
        return {"gbps": gbps, "choice": None, "fastest": fastest, "limit_s": limit,
                "times": times, "why": f"{', '.join(on_test)} scored on the test set; a choice "
                "ranks a validation split only (train.py --val-split; the sweep's --val-split)"}
    best = max(eligible, key=lambda r: (r["top1_mean"], -times[r["key"]]))
    return {"gbps": gbps, "choice": best, "fastest": fastest, "limit_s": limit, "times": times}


def _bytes(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def recommendation_line(rec: dict, within_pct: float) -> str:
    c, f, t = rec["choice"], rec["fastest"], rec["times"]
    if c is None:
        return f"{rec['gbps']:g} Gbit/s: no recommendation: {rec['why']}"
    return (f"{rec['gbps']:g} Gbit/s: {c['label']} "
            f"(top-1 {c['top1_mean']:.2f} ± {c['top1_sd']:.2f}%, "
            f"{_bytes(c['wire_bytes_per_step'])}/step, predicted {1e3 * t[c['key']]:.0f} ms/step); "
            f"fastest {f['label']} {1e3 * t[f['key']]:.0f} ms/step, within {within_pct:g}%: "
            f"<= {1e3 * rec['limit_s']:.0f} ms")


def markdown(rows: list, recs: list, links: list, ranks: int, within_pct: float,
             latency_us: float, header: str) -> str:
    dense = next((r["top1_mean"] for r in rows if r["method"] == "dense"), None)
    head = ("| setting | density | chunk | top-1 (%) | Δ vs dense | wire bytes/step | "
            "fewer bytes | run avg bytes/step | images/s | step ms (here) | codec ms | "
            + " | ".join(f"ms @ {g:g} Gb/s" for g in links) + " |")
    lines = [header, "", head, "|" + "---|" * (11 + len(links))]
    compute_s = compute_time(rows)
    for r in rows:
        delta = f"{r['top1_mean'] - dense:+.2f}" if dense is not None else "n/a"
        predicted = " | ".join(
            f"{1e3 * predict_step_s(r, g, ranks, latency_us, compute_s):.0f}" for g in links)
        lines.append(
            f"| {r['label']} | {r['density']:g} | {r['chunk_size'] or '-'} | "
            f"{r['top1_mean']:.2f} ± {r['top1_sd']:.2f} (n={r['seeds']}) | {delta} | "
            f"{_bytes(r['wire_bytes_per_step'])} | "
            f"{r['dense_bytes_per_step'] / max(r['wire_bytes_per_step'], 1):.0f}x | "
            f"{_bytes(r['wire_bytes_per_step_run'])} | {r['images_per_s']:.0f} | "
            f"{1e3 * r['step_s']:.0f} | {1e3 * r['codec_s']:.0f} | {predicted} |")
    lines += ["", f"t_compute = {1e3 * compute_s:.0f} ms (the dense runs' fastest epoch).", "",
              f"Recommendation (most accurate setting predicted within {within_pct:g}% of the "
              f"fastest step; {ranks} ranks, ring allreduce, latency {latency_us:g} µs per ring "
              f"step):",
              ""]
    lines += [f"- {recommendation_line(rec, within_pct)}" for rec in recs]
    return "\n".join(lines) + "\n"


def pareto_plot(rows: list, path: Path) -> Path:
    """Plot top-1 against wire bytes per step: a line per chunk size, dense, FP16, the front."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    csc = [r for r in rows if r["method"] == "csc"]
    for chunk in sorted({r["chunk_size"] for r in csc}):
        line = sorted((r for r in csc if r["chunk_size"] == chunk),
                      key=lambda r: r["wire_bytes_per_step"])
        ax.errorbar([r["wire_bytes_per_step"] for r in line], [r["top1_mean"] for r in line],
                    yerr=[r["top1_sd"] for r in line], marker="o", ms=4, capsize=3,
                    label=f"CSC, chunk {chunk}")
        for r in line:
            ax.annotate(f"{100 * r['density']:g}%", (r["wire_bytes_per_step"], r["top1_mean"]),
                        textcoords="offset points", xytext=(4, -10), fontsize=7)
    for method, marker, color in (("dense", "*", "black"), ("fp16", "D", "dimgray")):
        for r in (r for r in rows if r["method"] == method):
            ax.errorbar([r["wire_bytes_per_step"]], [r["top1_mean"]], yerr=[r["top1_sd"]],
                        marker=marker, ms=9 if marker == "*" else 6, color=color, capsize=3,
                        ls="none", label=r["label"])
    front = pareto_front(rows)
    ax.step([r["wire_bytes_per_step"] for r in front], [r["top1_mean"] for r in front],
            where="post", ls=":", color="gray", lw=1, label="Pareto front")
    ax.set_xscale("log")
    ax.set_xlabel("wire bytes per step, one rank (steady state, log scale)")
    ax.set_ylabel("final val top-1 (%), mean ± sd over seeds")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def pareto_front(rows: list) -> list:
    """Rows no other row beats on both accuracy and bytes, by increasing bytes."""
    front, best = [], float("-inf")
    for r in sorted(rows, key=lambda r: (r["wire_bytes_per_step"], -r["top1_mean"])):
        if r["top1_mean"] > best:
            front.append(r)
            best = r["top1_mean"]
    return front


def report(grid: list, seeds: list, args, links: list, common: list,
           csc_recipe: list) -> dict | None:
    """Write OUT/sweep.md, OUT/sweep.json and OUT/pareto.png from the finished logs; print them."""
    out: Path = args.out
    runs = collect(grid, seeds, out, args.epochs)
    if not runs:
        print(f"no finished runs under {out / 'logs'} yet")
        return None
    rows = summarise(runs)
    ranks = args.ranks or args.nproc
    recs = [recommend(rows, g, args.within, ranks, args.latency_us) for g in links]
    # The built-in data's path names the checkout: show it from the repository root.
    common = [BUILTIN_DATA_SUFFIX if str(a).endswith(BUILTIN_DATA_SUFFIX) else a for a in common]
    header = "\n".join([
        f"## CSC sweep: {args.epochs} epochs per run, {args.nproc} ranks, seeds "
        f"{', '.join(map(str, seeds))}", "",
        f"Every run: `train.py {' '.join(common)} --epochs {args.epochs} --seed S` plus the "
        f"setting's flags; CSC runs add `{' '.join(csc_recipe)}`. Top-1 is the last epoch's, "
        f"mean ± sd over seeds; wire bytes are what one rank hands to allreduce per step once "
        f"the warm-up is over (the run average includes it); images/s, step ms and codec ms "
        f"(the engine's compression time per step) are medians over epochs 1 and later, measured "
        f"here; 'ms @ link' is the model in sweep_report.py: t_compute + codec + bytes over the "
        f"link."])
    text = markdown(rows, recs, links, ranks, args.within, args.latency_us, header)
    (out / "sweep.md").write_text(text)
    (out / "sweep.json").write_text(json.dumps(
        {"rows": rows, "ranks": ranks, "within_pct": args.within, "latency_us": args.latency_us,
         "recommendations": [{"gbps": r["gbps"], "choice": r["choice"] and r["choice"]["key"],
                              "fastest": r["fastest"]["key"], "predicted_s": r["times"]}
                             for r in recs]}, indent=1) + "\n")
    plot = pareto_plot(rows, out / "pareto.png")
    print(text)
    print(f"Table: {out / 'sweep.md'}  Plot: {plot}  Logs: {out / 'logs'}")
    return {"rows": rows, "recommendations": recs}


__all__ = ["collect", "summarise", "predict_step_s", "recommend", "pareto_front",
           "pareto_plot", "report"]
