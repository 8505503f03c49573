"""The README's first screen, rendered from the committed results it cites: `make readme`.

    python experiments/imagenet/first_screen.py            # print the block
    python experiments/imagenet/first_screen.py --write    # replace it in README.md
    python experiments/imagenet/first_screen.py --check    # exit 1 where README.md differs

Three summaries feed it, each written by the run that made it: accuracy at convergence
(`converge.py`, results/fashion-converged/summary.json), time and bytes on an emulated switch
(`compare.py`, results/fashion/summary.json, with the run's meta files for its provenance) and the
transformer with AdamW (`experiments/lm/run_lm.py`, experiments/lm/results/summary.json). Every
number of the block is computed here from them, so that a rerun of a stage followed by `--write`
is the whole of updating the README, misses included; tests/experiments/test_readme_numbers.py
fails when README.md holds anything else.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
import compare  # noqa: E402
import protocol  # noqa: E402

README = ROOT / "README.md"
CONVERGED = "experiments/imagenet/results/fashion-converged"
COMPARED = "experiments/imagenet/results/fashion"
LM = "experiments/lm/results"
BEGIN = ("<!-- first screen: made by `python experiments/imagenet/first_screen.py --write` from "
         "the results it cites; edit that script, not this block -->")
END = "<!-- end of the first screen -->"
# What each model is, for a reader who has not opened models.py.
MODEL_NOTES = {"alexnet_shaped": "2.75 M weights, 98% in FC layers",
               "resnet_shaped": "0.70 M weights, 62 tensors"}
OURS, DDP = "csc-default", "ddp-gloo"
BESIDE = ("csc-default-mc", "torch-fp16", "powersgd-4")
GOAL_POINTS = 0.3  # the goal: the CSC default within this many points of DDP at convergence
WIDTH = 100  # the README's line length
RECIPES = {"plain": "plain SGD", "schedule": "warm-up + cosine"}


def _load(folder: str, root: Path) -> dict | list:
    return json.loads((root / folder / "summary.json").read_text())


def _pm(values: list) -> str:
    mean, sd = compare.mean_sd(values)
    return f"{mean:.2f}% ± {sd:.2f}"


def _diff(d: dict) -> str:
    return f"{d['mean']:+.2f} ({d['low']:+.2f} to {d['high']:+.2f}, n={len(d['seeds'])})"


def _kb(kb: float) -> str:
    return f"{kb / 1000:.2f} MB" if kb >= 1000 else f"{kb:.0f} kB"


def accuracy(conv: dict) -> list[str]:
    """The converged table: DDP against the CSC default per model, and the others beside."""
    seeds = sorted({int(s) for m in conv.values() for r in m.values() for s in r["test_top1"]})
    lines = [f"**Accuracy at convergence** (Fashion-MNIST, 70,000 real images; 2 CPU ranks; "
             f"warm-up + cosine over 30 epochs; seeds {seeds[0]}-{seeds[-1]}, which no choice "
             f"of recipe or default saw; the test set read once, after the last epoch; mean ± "
             f"standard deviation, and the paired difference to DDP with its 95% interval; "
             f"`{CONVERGED}/results.md`):", "",
             "| model | DDP (gloo): test top-1, bytes a step | GradientFlow CSC 1%, default "
             "recipe | difference (points) | fewer bytes |", "|---|---|---|---|---|"]
    for model, rows in conv.items():
        ddp, ours = rows[DDP], rows[OURS]
        kb_d, kb_o = (statistics.median(r["wire_kb"].values()) for r in (ddp, ours))
        lines.append(f"| {compare.LABELS[model]} ({MODEL_NOTES[model]}) | "
                     f"{_pm(list(ddp['test_top1'].values()))}, {_kb(kb_d)} | "
                     f"{_pm(list(ours['test_top1'].values()))}, {_kb(kb_o)} | "
                     f"{_diff(ours['vs_ddp'])} | {kb_d / kb_o:.0f}x |")
    beside = []
    for key in BESIDE:
        got = [(compare.LABELS[m], rows[key]) for m, rows in conv.items()
               if rows.get(key, {}).get("vs_ddp")]
        if got:
            beside.append(f"{got[0][1]['label']} " + ", ".join(
                f"{_diff(r['vs_ddp'])} on {label}" for label, r in got))
    means = [rows[OURS]["vs_ddp"] for rows in conv.values()]
    met = all(d["mean"] >= -GOAL_POINTS for d in means)
    ruled = all(d["low"] >= -GOAL_POINTS for d in means)
    lines += ["", "Beside them, paired to DDP on the same seeds: " + "; ".join(beside) + ". "
              f"Goal, the CSC default within {GOAL_POINTS} points of DDP: **"
              + ("met" if met else "missed") + "** on the means ("
              + ", ".join(f"{d['mean']:+.2f}" for d in means) + "); the intervals "
              + ("rule out" if ruled else "do not rule out") + f" a loss of more than "
              f"{GOAL_POINTS} points."]
    return lines


def _step(summary: dict, link: str, key: str) -> tuple | None:
    """(ms, fastest ms, slowest ms, repeats) of a setting's step on a link, where it ran."""
    t = summary.get("steps", {}).get(link, {}).get(key)
    if not t:
        return None
    (lo, hi), n = summary.get("step_spread", {}).get(link, {}).get(key) or ((None, None), None)
    return 1e3 * t, lo and 1e3 * lo, hi and 1e3 * hi, n


def _ms(step: tuple) -> str:
    ms, lo, hi, n = step
    return f"{ms:.0f}" + (f" ({lo:.0f}-{hi:.0f}, n={n})" if n else "")


def _provenance(root: Path) -> str:
    """Which runs the time table comes from: their seeds, and the commits, hosts and span their
    meta files record (runs made before those were recorded say so)."""
    seeds = compare.load_stage(root / COMPARED / compare.MODELS[0] / "1gbps-plain")["seeds"]
    seeds = seeds.get(DDP, [])
    prov = compare.provenance(root / COMPARED)
    said = f"seeds {', '.join(map(str, seeds))}"
    if seeds and min(seeds) < protocol.REPORT_SEEDS[0]:
        said += " (the seeds the defaults were once chosen on, not report seeds)"
    if prov["runs"] and prov["without_times"] == prov["runs"]:
        return (f"{said}; its {prov['runs']} runs were made before runs recorded their commit, "
                "host and times, over several invocations: `make compare` remakes it as one run")
    return f"{said}. " + compare.provenance_line(prov).rstrip(".")


def timing(comp: list, root: Path) -> list[str]:
    """The time table of the one `make compare` run, plain SGD, and every target it set."""
    comp = [res for res in comp if "plain" in res["recipes"]]  # a model whose stage ran
    rec0 = comp[0]["recipes"]["plain"]
    lines = ["", f"**Time** (the same models, 2 CPU ranks on an emulated switch, plain "
             f"SGD, {rec0['rows'][DDP]['epochs']} epochs; step: the median of the repeats, "
             f"fastest-slowest and n in brackets where recorded; time to the target top-1: "
             f"training time to the first epoch at or above it, mean of seeds; at 10 Gbit/s "
             f"derived from the step time there; bytes: what rank 0's NIC sent per step, every "
             f"protocol's; `{COMPARED}/results.md`): "
             + _provenance(root) + ".", "",
             "| model, link | DDP step (ms) | CSC step (ms) | DDP's step over CSC's | most any "
             "setting could gain | time to target: DDP, CSC (s) | sooner | MB a step: DDP, CSC |",
             "|---|---|---|---|---|---|---|---|"]
    misses = []
    for res in comp:
        plain = res["recipes"]["plain"]
        ddp, ours = plain["rows"][DDP], plain["rows"][OURS]
        for link, col in (("1 Gbit/s", "time_to_target_1g"),
                          ("10 Gbit/s", "time_to_target_10g"),
                          (compare.FOUR_RANK_LINK, None)):
            sd, so, sb = (_step(res, link, k) for k in (DDP, OURS, compare.BOUND))
            if not sd or not so:
                continue
            td, to = (compare._mean(ddp[col]), compare._mean(ours[col])) if col else (0, 0)
            derived = "" if link == "1 Gbit/s" else ", derived"
            nic = (f"{compare._mb(ddp['wire_bytes_per_step_nic'])}, "
                   f"{compare._mb(ours['wire_bytes_per_step_nic'])}" if link == "1 Gbit/s"
                   else "-")
            lines.append(
                f"| {compare.LABELS[res['model']]} (target {plain['target_top1']:g}%), {link} | "
                f"{_ms(sd)} | {_ms(so)} | {sd[0] / so[0]:.2f}x | "
                + (f"{sd[0] / sb[0]:.2f}x" if sb else "-") + " | "
                + (f"{td:.0f}, {to:.0f}{derived} | {td / to:.2f}x |" if td and to else "- | - |")
                + f" {nic} |")
        for recipe, rec in res["recipes"].items():
            misses += [f"{compare.LABELS[res['model']]}, {RECIPES[recipe]}: {text}: {numbers}"
                       for text, ok, numbers in rec["verdict"] if not ok]
    lines += ["", "Targets missed there: " + ("; ".join(misses) if misses else "none")
              + ". Every peer (torch's FP16 and PowerSGD hooks, Horovod, GradientFlow FP16) and "
              "the warm-up + cosine recipe: that file."]
    return lines


def language_model(lm: dict) -> list[str]:
    """The transformer with AdamW, where CSC does not hold: said on the first screen."""
    csc, fp16 = lm["csc"]["vs_ddp_pct"], lm["torch-fp16"]["vs_ddp_pct"]
    return ["", f"**Where it does not hold:** a byte-level GPT trained with AdamW (`{LM}/"
            f"results.md`, {len(csc['seeds'])} seeds): CSC 1% ends {csc['mean']:+.1f}% "
            f"({csc['low']:+.1f} to {csc['high']:+.1f}) above DDP's validation loss, torch's "
            f"FP16 hook {fp16['mean']:+.2f}% ({fp16['low']:+.2f} to {fp16['high']:+.2f}); "
            "`hooks.register` refuses CSC beside an Adam-family optimizer unless told, naming "
            "what works (the FP16 wire, or CSC with SGD and momentum)."]


def render(root: Path = ROOT) -> str:
    """The whole block, markers included."""
    conv, comp, lm = (_load(f, root) for f in (CONVERGED, COMPARED, LM))
    lines = [*accuracy(conv), *timing(comp, root), *language_model(lm)]
    # Paragraphs wrapped as the rest of the README is; table rows stay one line each.
    lines = [line if line.startswith("|") or not line else
             textwrap.fill(line, WIDTH, break_long_words=False, break_on_hyphens=False)
             for line in lines]
    return "\n".join([BEGIN, *lines, END])


def replaced(readme: str, block: str) -> str:
    """README text with its first-screen block (markers included) replaced by `block`."""
    start, end = readme.index(BEGIN), readme.index(END) + len(END)
    return readme[:start] + block + readme[end:]


def current(readme: str) -> str:
    """The first-screen block README text holds now, markers included."""
    return readme[readme.index(BEGIN):readme.index(END) + len(END)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="replace the block in README.md")
    mode.add_argument("--check", action="store_true", help="exit 1 where README.md differs")
    args = p.parse_args(argv)
    block = render()
    if args.write:
        README.write_text(replaced(README.read_text(), block))
    elif args.check:
        if current(README.read_text()) != block:
            print("README.md's first screen differs from its results: run "
                  "python experiments/imagenet/first_screen.py --write", file=sys.stderr)
            return 1
    else:
        print(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
