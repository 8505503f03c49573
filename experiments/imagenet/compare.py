"""GradientFlow against the peers a user would pick instead, on Fashion-MNIST: `make compare`.

    python experiments/imagenet/compare.py              # every stage (resumes), then the report
    python experiments/imagenet/compare.py --no-run     # the report from the logs alone
    python experiments/imagenet/compare.py --quick      # 1 seed, 40 steps an epoch: the machinery

Two models (models.py: AlexNet-shaped and ResNet-shaped), 2 CPU ranks on an emulated switch
(benchmarks/netem.py: a network namespace per rank, tbf both ways; root), the peers of
run_experiment.PEERS plus the no-communication bound, each run by run_experiment.py. Stages:

1. 1 Gbit/s, plain SGD (constant learning rate), every peer, 3 seeds, full epochs: accuracy,
   epochs and time to the target, wire bytes measured on the NIC, images/s.
2. 1 Gbit/s, warm-up + cosine schedule, DDP and GradientFlow's default, 3 seeds.
3. 1 and 10 Gbit/s, every peer and the bound, --step-repeats runs each (5; one seed per
   repeat, the settings interleaved within each), a capped number of steps: the step time on
   each link as the median of the repeats with their range (its own table: a short stage that
   stands without stages 1-2, and the bound's step says the most any setting can gain over
   DDP's there). Training is the same
   computation whatever the link (the link changes when bytes arrive, not what they are), so
   the time to the target at 10 Gbit/s is each seed's epochs to the target from stage 1 times
   the step time measured here. Stated as derived in the table.
4. 4 ranks at 1 Gbit/s (AlexNet-shaped): the step time, the same way.

The target top-1 of a model and recipe is what every DDP seed has reached by its
next-to-last epoch (the lowest of them, rounded down to half a point): a target dense reaches,
with one epoch to spare. Within every stage the settings interleave seed by seed (A B C A B C,
not A A A B B B), so that a drift of the machine's load hits them alike. Each stage holds --lock
during each run (not between runs) and records the load average before and after it; every
run's meta file also has its start and end time, the commit, the host and each rank's CPU time,
and the report's header says which commits, hosts and time span its runs cover.
Writes OUT/results.md, OUT/summary.json, OUT/<model>.png.
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import protocol  # noqa: E402
import run_experiment as rx  # noqa: E402
from sweep import read_log  # noqa: E402

MODELS = ("alexnet_shaped", "resnet_shaped")
FOUR_RANKS = "alexnet_shaped"
FOUR_RANK_LINK = "4 ranks, 1 Gbit/s"
# The step-time stages by the link they time (the 4-rank one only for FOUR_RANKS).
STEP_STAGES = {"1 Gbit/s": "1gbps-step", "10 Gbit/s": "10gbps-step",
               FOUR_RANK_LINK: "1gbps-4ranks-step"}
LABELS = {"alexnet_shaped": "AlexNet-shaped", "resnet_shaped": "ResNet-shaped"}
BOUND = rx.LIMIT
DEFAULT_OUT = HERE / "results" / "fashion"
# The machine-wide lock timing runs here take; elsewhere one of our own.
LOCK = (Path("/work/timing.lock") if Path("/work").is_dir()
        else Path("/tmp/gradientflow-timing.lock"))


def stages(args) -> list:
    """(folder, run_experiment argv) of every stage, in the order they run."""
    seeds = [str(s) for s in args.seeds]
    common = ["--data", "fashion-mnist", "--keep", "--timeout", str(args.timeout)]
    if args.lock and str(args.lock) != "none":
        common += ["--lock", str(args.lock)]
    # The protocol (protocol.py): every epoch is scored on the validation split (the target and
    # the time to it), the test set once at the end of a training stage (the reported top-1).
    split = f"--val-split {protocol.VAL_SPLITS['fashion-mnist']}"
    cap = ["--train-args", f"{split} --report-test"
           + (f" --steps-per-epoch {args.quick_steps}" if args.quick else "")]
    step = ["--train-args", f"{split} --steps-per-epoch {args.step_steps}"]
    # The step-time stages repeat (one seed per repeat), interleaved like every stage.
    repeats = [str(r) for r in range(args.step_repeats)]
    chosen = args.peers

    def peers(*keys: str) -> list:
        """The settings of a stage, those --peers names where it names any."""
        return [k for k in keys if chosen is None or k in chosen]

    out = []
    for model in MODELS:
        base = common + ["--arch", model]
        out.append((f"{model}/1gbps-plain", base + [
            "--recipe", "plain", "--settings", *peers(*rx.PEERS, BOUND), "--seeds", *seeds,
            "--epochs", str(args.epochs), "--link-gbps", "1", *cap]))
        out.append((f"{model}/1gbps-schedule", base + [
            "--recipe", "schedule", "--settings", *peers("ddp-gloo", rx.OURS), "--seeds", *seeds,
            "--epochs", str(args.epochs), "--link-gbps", "1", *cap]))
        out.append((f"{model}/{STEP_STAGES['1 Gbit/s']}", base + [
            "--recipe", "plain", "--settings", *peers(*rx.PEERS, BOUND), "--seeds", *repeats,
            "--epochs", "2", "--link-gbps", "1", *step]))
        out.append((f"{model}/{STEP_STAGES['10 Gbit/s']}", base + [
            "--recipe", "plain", "--settings", *peers(*rx.PEERS, BOUND), "--seeds", *repeats,
            "--epochs", "2", "--link-gbps", "10", *step]))
    out.append((f"{FOUR_RANKS}/{STEP_STAGES[FOUR_RANK_LINK]}", common + [
        "--arch", FOUR_RANKS, "--recipe", "plain", "--settings", *peers(*rx.PEERS, BOUND),
        "--seeds", *repeats,
        "--epochs", "2", "--link-gbps", "1", "--nproc", "4", *step]))
    return out


def warm_up(out: Path) -> None:
    """One short untimed run of each GradientFlow setting: numba compiles its kernels into its
    cache once, so that no timed run pays for the compilation."""
    rx.main(["--data", "fashion-mnist", "--settings", "gf-fp16", rx.OURS, "--seeds", "0",
             "--epochs", "1", "--train-args", "--steps-per-epoch 8", "--out", str(out)])


def load_stage(folder: Path) -> dict:
    """{setting: [log per seed]} of a stage's finished runs, their seeds in the same order,
    plus 'unavailable' reasons."""
    runs = {}
    for path in sorted((folder / "logs").glob("*.jsonl")):
        key, _, seed = path.stem.rpartition("-seed")
        log = read_log(path)
        if log:
            runs.setdefault(key, {})[int(seed)] = log
    why = folder / "unavailable.json"
    return {"runs": {k: [v[s] for s in sorted(v)] for k, v in runs.items()},
            "seeds": {k: sorted(v) for k, v in runs.items()},
            "unavailable": json.loads(why.read_text()) if why.exists() else {}}


def target_of(ddp_logs: list) -> float | None:
    """The lowest top-1 the DDP seeds reach by their next-to-last epoch, rounded down to 0.5."""
    if not ddp_logs or min(len(log) for log in ddp_logs) < 2:
        return None
    return math.floor(2 * min(max(r["val_top1"] for r in log[:-1]) for log in ddp_logs)) / 2


def step_time(logs: list) -> float | None:
    """Seconds per step of a timing stage: the median over its repeats of each run's last epoch
    (the first pays for start-up)."""
    if not logs:
        return None
    return statistics.median(log[-1]["train_time_s"] / log[-1]["steps"] for log in logs)


def step_spread(logs: list) -> tuple | None:
    """(fastest, slowest) seconds per step over a timing stage's repeats."""
    if not logs:
        return None
    steps = [log[-1]["train_time_s"] / log[-1]["steps"] for log in logs]
    return min(steps), max(steps)


def provenance(out: Path) -> dict:
    """Every run's meta file under `out`: the commits and hosts, the first start and last end,
    how many runs: whether a table comes from one invocation of one commit."""
    metas = [json.loads(p.read_text()) for p in sorted(out.rglob("*.meta.json"))]
    starts = [m["started_utc"] for m in metas if m.get("started_utc")]
    ends = [m["ended_utc"] for m in metas if m.get("ended_utc")]
    return {"runs": len(metas), "commits": sorted({m.get("commit", "unrecorded") for m in metas}),
            "hosts": sorted({m.get("host", "unrecorded") for m in metas}),
            "first_start": min(starts) if starts else None, "last_end": max(ends) if ends else None,
            "without_times": len(metas) - len(starts)}


def reported_top1(log: list) -> float:
    """The run's test top-1, read once after its last epoch (--report-test); runs made before
    the protocol have none, and their last epoch's score (on the test set) stands in."""
    if log[-1].get("eval_set") == "validation":
        return protocol.report_top1(log)
    return log[-1]["val_top1"]


def mean_sd(values: list) -> tuple:
    vals = [v for v in values if v is not None]
    if not vals:
        return None, None
    return statistics.mean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0


def peer_row(key: str, logs: list, target: float, step10: float | None,
             step4: float | None) -> dict:
    """One setting's numbers: accuracy, epochs and time to `target`, bytes, speed."""
    epochs = [rx.epoch_at_top1(log, target) for log in logs]
    times = [rx.time_to_top1(log, target) for log in logs]
    steps = logs[0][0]["steps"]
    nic = [log[-1].get("nic_tx_bytes") for log in logs]
    nic = [n / log[-1]["steps"] for n, log in zip(nic, logs) if n is not None]
    derived10 = [(e + 1) * steps * step10 if e is not None and step10 else None for e in epochs]
    derived4 = [(e + 1) * steps * step4 if e is not None and step4 else None for e in epochs]
    return {
        "label": rx.SETTINGS[key][0], "seeds": len(logs),
        "top1": [reported_top1(log) for log in logs],
        "epoch_at_target": epochs, "time_to_target_1g": times,
        "wire_bytes_per_step_nic": statistics.median(nic) if nic else None,
        "wire_bytes_per_step_counted": statistics.median(log[-1]["wire_bytes_per_step"]
                                                         for log in logs),
        "images_per_s_1g": statistics.median(r["images_per_s"] for log in logs
                                             for r in (log[1:] or log)),
        "step_s_10g": step10, "time_to_target_10g": derived10,
        "step_s_4ranks": step4, "time_to_target_4ranks": derived4,
        "loadavg": [], "epochs": len(logs[0]),
    }


def step_rows(stages: dict) -> dict:
    """{link: {setting: seconds per step}} of the loaded step-time stages ({link: stage}) that
    ran."""
    got = {}
    for link, stage in stages.items():
        steps = {key: step_time(logs) for key, logs in stage["runs"].items()}
        if steps:
            got[link] = steps
    return got


def summarise_model(out: Path, model: str) -> dict:
    """Every stage of one model gathered into rows per recipe, with the targets' verdicts."""
    plain = load_stage(out / model / "1gbps-plain")
    sched = load_stage(out / model / "1gbps-schedule")
    timed = {link: load_stage(out / model / folder) for link, folder in STEP_STAGES.items()
             if link != FOUR_RANK_LINK or model == FOUR_RANKS}
    steps = step_rows(timed)
    ten, four = steps.get("10 Gbit/s", {}), steps.get(FOUR_RANK_LINK, {})
    result = {"model": model, "recipes": {}, "steps": steps,
              "step_spread": {link: {key: (step_spread(logs), len(logs))
                                     for key, logs in stage["runs"].items()}
                              for link, stage in timed.items() if link in steps}}
    for recipe, stage in (("plain", plain), ("schedule", sched)):
        target = target_of(stage["runs"].get("ddp-gloo", []))
        if target is None:
            continue
        rows = {}
        for key, logs in stage["runs"].items():
            rows[key] = peer_row(key, logs, target, ten.get(key), four.get(key))
            metas = [rx.read_meta(out / model / f"1gbps-{recipe}", key, s)
                     for s in stage["seeds"][key]]
            rows[key]["loadavg"] = [m["loadavg_before"][0] for m in metas if m]
        unavailable = dict(stage["unavailable"])
        for link in ("10 Gbit/s", FOUR_RANK_LINK):
            for key, why in timed.get(link, {"unavailable": {}})["unavailable"].items():
                unavailable.setdefault(key, why)
        result["recipes"][recipe] = {"target_top1": target, "rows": rows,
                                     "unavailable": unavailable,
                                     "verdict": verdict(rows, recipe)}
    return result


def _mean(values: list) -> float | None:
    return mean_sd(values)[0]


def verdict(rows: dict, recipe: str) -> list:
    """The issue's targets for GradientFlow's default against DDP and the best other peer,
    each as (statement, met or not, the numbers)."""
    ours, ddp = rows.get(rx.OURS), rows.get("ddp-gloo")
    if not ours or not ddp:
        return []
    out = []
    gap = _mean(ours["top1"]) - _mean(ddp["top1"])
    out.append(("top-1 within 0.5 point of DDP (mean of seeds)", gap >= -0.5,
                f"{gap:+.2f} points"))
    extra = [o - d if o is not None and d is not None else None
             for o, d in zip(ours["epoch_at_target"], ddp["epoch_at_target"])]
    out.append(("at most one epoch more than DDP to the target (every seed)",
                all(x is not None and x <= 1 for x in extra),
                ", ".join("not reached" if x is None else f"{x:+d}" for x in extra)))
    if recipe != "plain":
        return out
    t_ours, t_ddp = _mean(ours["time_to_target_1g"]), _mean(ddp["time_to_target_1g"])
    ratio = t_ddp / t_ours if t_ours and t_ddp else None
    out.append(("1 Gbit/s: time to target >= 3x sooner than DDP", bool(ratio and ratio >= 3),
                f"{ratio:.2f}x" if ratio else "not reached"))
    others = {k: _mean(r["time_to_target_1g"]) for k, r in rows.items()
              if k not in (rx.OURS, "ddp-gloo", BOUND)}
    others = {k: t for k, t in others.items() if t}
    if others and t_ours:
        best = min(others, key=others.get)
        r = others[best] / t_ours
        out.append(("1 Gbit/s: >= 1.5x sooner than the best other peer", r >= 1.5,
                    f"{r:.2f}x ({rows[best]['label']})"))
    t10o, t10d = _mean(ours["time_to_target_10g"]), _mean(ddp["time_to_target_10g"])
    if t10o and t10d:
        out.append(("10 Gbit/s: never slower than DDP (derived)", t10o <= t10d,
                    f"{t10d / t10o:.2f}x"))
    return out


def _s(values: list) -> str:
    m, sd = mean_sd(values)
    return "-" if m is None else f"{m:.0f} ± {sd:.0f}"


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:.3f}" if n >= 1e4 else f"{n / 1e6:.4f}"


def provenance_line(prov: dict) -> str:
    """Where the table's runs come from, said once: commits, hosts, the time span."""
    if not prov or not prov.get("runs"):
        return ""
    return (f"Runs: {prov['runs']} from commit(s) {', '.join(prov['commits'])} on "
            f"{', '.join(prov['hosts'])}, started {prov['first_start'] or '?'} and ended "
            f"{prov['last_end'] or '?'} (UTC)"
            + (f"; {prov['without_times']} without recorded times (older runs)"
               if prov["without_times"] else "") + ".")


def markdown(results: list, epochs: int, seeds: list, command: str,
             prov: dict | None = None) -> str:
    lines = ["# GradientFlow against what a user would pick instead: Fashion-MNIST", "",
             f"2 CPU ranks on an emulated switch (a network namespace per rank, tbf both ways), "
             f"global batch 128, {epochs} epochs, seeds {', '.join(map(str, seeds))}; "
             f"mean ± standard deviation over seeds of the test top-1, read once after the last "
             f"epoch (runs made before the protocol: the last epoch's test score). Every epoch "
             f"is scored on the validation split held out of the training set (runs before the "
             f"protocol: on the test set). Target: the validation top-1 every DDP seed reached by "
             f"its next-to-last epoch. Time to target: the training time (validation left out) "
             f"up to the first epoch at or above it. Wire bytes: what rank 0's NIC sent per step "
             f"in the last epoch (every protocol's bytes). 10 Gbit/s and 4 ranks: each seed's "
             f"epochs to the target at 1 Gbit/s times the step time measured there (derived: "
             f"the link changes when bytes arrive, not what they are). A setting missing from "
             f"a table did not run in that stage (the command's --peers, or its own line says "
             f"why).", "", *([provenance_line(prov), ""] if provenance_line(prov) else [])]
    for res in results:
        for recipe, rec in res["recipes"].items():
            lines += [f"## {LABELS[res['model']]}, {recipe} recipe: target "
                      f"{rec['target_top1']:g}% top-1", "",
                      "| setting | top-1 (%) | epoch at target | time to target 1 Gbit/s (s) "
                      "| DDP's over it | wire MB/step | images/s 1 Gbit/s | step 10 Gbit/s (ms) "
                      "| time to target 10 Gbit/s (s, derived) | DDP's over it | step 4 ranks "
                      "1 Gbit/s (ms) | load |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|"]
            ddp = rec["rows"].get("ddp-gloo", {})
            for key in [*rx.PEERS, BOUND]:
                if key in rec["unavailable"]:
                    lines.append(f"| {rx.SETTINGS[key][0]} | did not run: "
                                 f"{rec['unavailable'][key]} |" + " |" * 10)
                if key not in rec["rows"]:
                    continue
                r = rec["rows"][key]
                bound = key == BOUND
                t1, d1 = _mean(r["time_to_target_1g"]), _mean(ddp.get("time_to_target_1g", []))
                t10, d10 = (_mean(r["time_to_target_10g"]),
                            _mean(ddp.get("time_to_target_10g", [])))
                m, sd = mean_sd(r["top1"])
                lines.append(
                    f"| {r['label']} | "
                    + ("(ranks do not average) | | | |" if bound else
                       f"{m:.2f} ± {sd:.2f} | "
                       + ", ".join("-" if e is None else str(e) for e in r["epoch_at_target"])
                       + f" | {_s(r['time_to_target_1g'])} | "
                       + (f"{d1 / t1:.2f}x" if t1 and d1 else "-") + " |")
                    + f" {_mb(r['wire_bytes_per_step_nic'])} | {r['images_per_s_1g']:.0f} | "
                    + (f"{1e3 * r['step_s_10g']:.0f}" if r["step_s_10g"] else "-") + " | "
                    + ("" if bound else _s(r["time_to_target_10g"])) + " | "
                    + (f"{d10 / t10:.2f}x" if t10 and d10 and not bound else "") + " | "
                    + (f"{1e3 * r['step_s_4ranks']:.0f}" if r["step_s_4ranks"] else "-") + " | "
                    + ", ".join(f"{x:.1f}" for x in r["loadavg"]) + " |")
            lines += ["", "Targets for GradientFlow's default (CSC 1%):", ""]
            lines += [f"- {text}: **{'met' if ok else 'missed'}** ({numbers})"
                      for text, ok, numbers in rec["verdict"]]
            lines.append("")
    for res in results:
        lines += step_markdown(res)
    lines += [f"Command: `{command}`", ""]
    return "\n".join(lines)


def step_markdown(res: dict) -> list[str]:
    """One model's step times per link, and each setting's speed-up over DDP's step there."""
    steps = res.get("steps") or {}
    if not steps:
        return []
    links = list(steps)
    spread = res.get("step_spread") or {}
    lines = [f"## {LABELS[res['model']]}: step time by link (each run's last of two capped "
             "epochs; the median over the stage's repeats, fastest-slowest in brackets, n "
             "repeats, interleaved setting by setting)", "",
             "| setting | " + " | ".join(f"{link}: ms (range, n), DDP's over it"
                                       for link in links) + " |",
             "|---|" + "---|" * len(links)]
    for key in [*rx.PEERS, BOUND]:
        if not any(key in steps[link] for link in links):
            continue
        cells = []
        for link in links:
            t, d = steps[link].get(key), steps[link].get("ddp-gloo")
            (lo, hi), n = spread.get(link, {}).get(key) or ((t, t), 1)
            ms = f"{1e3 * t:.0f} ({1e3 * lo:.0f}-{1e3 * hi:.0f}, n={n})" if t else "-"
            cells.append(ms if not t or not d else f"{ms}, {d / t:.2f}x")
        lines.append(f"| {rx.SETTINGS[key][0]} | " + " | ".join(cells) + " |")
    lines.append("")
    for link in links:
        t, d = steps[link].get(BOUND), steps[link].get("ddp-gloo")
        if t and d:
            lines.append(f"- {link}: no setting can step more than {d / t:.2f}x faster than "
                         "DDP here (DDP's step over the no-communication bound's).")
    lines.append("")
    return lines


def plot(out: Path, res: dict) -> Path | None:
    """Top-1 against training time at 1 Gbit/s (plain recipe), one line per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stage = load_stage(out / res["model"] / "1gbps-plain")
    if not stage["runs"]:
        return None
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for key in rx.PEERS:
        logs = stage["runs"].get(key)
        if not logs:
            continue
        n = min(len(log) for log in logs)
        t = [statistics.mean(sum(r["train_time_s"] for r in log[:e + 1]) for log in logs)
             for e in range(n)]
        acc = [statistics.mean(log[e]["val_top1"] for log in logs) for e in range(n)]
        style = dict(lw=2.5, color="black") if key == rx.OURS else dict(lw=1.2)
        ax.plot(t, acc, marker="o", ms=3, label=rx.SETTINGS[key][0], **style)
        nic = [log[-1].get("nic_tx_bytes") or 0 for log in logs]
        bx.barh(rx.SETTINGS[key][0], statistics.mean(nic) / logs[0][-1]["steps"] / 1e6,
                color="black" if key == rx.OURS else "tab:blue")
    target = res["recipes"].get("plain", {}).get("target_top1")
    if target:
        ax.axhline(target, color="grey", ls=":", lw=1)
    ax.set_xlabel("training time at 1 Gbit/s (s)")
    ax.set_ylabel("test top-1 (%)")
    ax.set_title(f"{LABELS[res['model']]}: top-1 against time (mean of seeds)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    bx.set_xscale("log")
    bx.set_xlabel("MB per step on rank 0's NIC (log)")
    bx.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    path = out / f"{res['model']}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", nargs="+", type=int, default=list(protocol.REPORT_SEEDS[:3]),
                   help="the training stages' seeds: report seeds, 10 and up (protocol.py)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--lock", type=Path, default=LOCK,
                   help="flock held during each timed run (default: %(default)s; none: no lock)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed per run")
    p.add_argument("--step-steps", type=int, default=60,
                   help="steps per epoch of the step-time stages (10 Gbit/s, 4 ranks)")
    p.add_argument("--step-repeats", type=int, default=5,
                   help="runs of each setting in each step-time stage, interleaved (default 5)")
    p.add_argument("--quick", action="store_true",
                   help="one seed, --quick-steps steps an epoch: checks the machinery only")
    p.add_argument("--quick-steps", type=int, default=40)
    p.add_argument("--only", nargs="+", default=None, help="run only the stages whose folder "
                   "starts with one of these (e.g. alexnet_shaped/1gbps-plain)")
    p.add_argument("--peers", nargs="+", default=None, choices=[*rx.PEERS, BOUND],
                   help="run only these settings (DDP and GradientFlow's default always run: "
                   "the targets compare them); the report still lists every peer")
    p.add_argument("--no-run", action="store_true", help="only the report from OUT's logs")
    args = p.parse_args(argv)
    if args.peers is not None:
        args.peers = sorted({*args.peers, "ddp-gloo", rx.OURS})
    try:  # a report of logs already made (--no-run) may name the seeds they were made on
        if not args.no_run:
            protocol.check_role("report", args.seeds)
    except protocol.ProtocolError as exc:
        p.error(str(exc))
    if args.quick:
        args.seeds, args.step_repeats = args.seeds[:1], min(args.step_repeats, 2)
    command = "python experiments/imagenet/compare.py " + " ".join(map(shlex.quote, argv))
    t0 = time.perf_counter()
    if not args.no_run:
        warm_up(HERE / "runs" / "compare-warmup")
        for folder, stage_argv in stages(args):
            if args.only and not any(folder.startswith(o) for o in args.only):
                continue
            print(f"=== {folder} ===", flush=True)
            code = rx.main(stage_argv + ["--out", str(args.out / folder)])
            if code != 0:
                print(f"compare.py: stage {folder} failed (exit {code}); the report covers "
                      f"what finished", file=sys.stderr)
    results = [summarise_model(args.out, m) for m in MODELS]
    (args.out / "summary.json").parent.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(results, indent=2) + "\n")
    text = markdown(results, args.epochs, args.seeds, command.strip(), provenance(args.out))
    (args.out / "results.md").write_text(text)
    plots = [p for p in (plot(args.out, r) for r in results) if p]
    print(text)
    print(f"{(time.perf_counter() - t0) / 60:.1f} min; table {args.out / 'results.md'}; plots "
          f"{', '.join(map(str, plots))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
