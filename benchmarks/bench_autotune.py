"""Autotune against a grid of the same settings, on real models' gradient lists, in one launch.

Each rank allreduces a model's gradient list asynchronously, one call per tensor in backward
order, then waits for all of them: one "step". On one gradientflow group per model:
  1. autotune (gradientflow.autotune.Tuner, its defaults unless given) runs step after step
     until it has chosen; the steps it took are counted;
  2. then the defaults, autotune's choice and every point of a grid of the same settings are
     timed alternately, rep by rep (order rotated), switching the group between them with
     GradientFlowBackend.reconfigure (the same drain-and-swap autotune uses), so all variants
     meet the same machine load. A variant's time in a rep is the median of --steps steps
     after one discarded warm-up step (new segments, new routes).
  3. the grid's best point then meets autotune's choice and the defaults head to head, in
     --h2h more alternated reps: picked and compared on the same reps, the minimum of a dozen
     noisy medians is biased low by the noise alone (that figure is given too).
The table gives autotune's choice against the best grid point (target: within 5%), and its
gain over the defaults, both as medians of per-rep ratios of the head-to-head reps. On
loopback; --tiers adds the emulated network of benchmarks/netem.py.

    python benchmarks/bench_autotune.py [--quick] [--out DIR] [--worlds 2,4] [--tiers none,10]
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_fusion import _tier_label, gradient_shapes  # noqa: E402
from benchmarks.common import machine_line, markdown_table, median, paired_ratio, write_result  # noqa: E402,E501
from benchmarks.launch import launch  # noqa: E402
from benchmarks.netem import Cluster, ShapeConfig  # noqa: E402

MB = 10**6
DEFAULT, AUTOTUNE = "defaults", "autotune"


def grid_points(quick: bool) -> list[dict]:
    """The grid: fusion threshold x solo threshold x cycle time (2 fusion segments)."""
    if quick:
        axes = ([1 * MB, 16 * MB], [256 * 1024, 4 * MB], [1.0, 3.0])
    else:
        axes = ([8 * MB, 128 * MB], [1 * MB, 4 * MB, 16 * MB], [1.0, 3.0])
    return [{"fusion_threshold": f, "solo_threshold": s, "cycle_time_ms": c,
             "fusion_segments": 2} for f, s, c in itertools.product(*axes)]


def _label(p: dict) -> str:
    return (f"fuse {p['fusion_threshold'] / MB:g}MB solo {p['solo_threshold'] / MB:g}MB "
            f"cycle {p['cycle_time_ms']:g}ms seg {p['fusion_segments']}")


def worker(rank: int, world_size: int, models: list[str], grid: list[dict], reps: int,
           tuner: dict, steps: int = 3, h2h: int = 8) -> dict:
    """Per model: autotune; the grid search (alternated reps of defaults, choice and grid);
    then `h2h` head-to-head reps of autotune's choice, the grid's winner and the defaults."""
    import time

    import torch
    import torch.distributed as dist

    from gradientflow.autotune import Tuner
    from gradientflow.backend import backend_of

    torch.set_num_threads(1)
    out: dict = {}
    for model in models:
        group = dist.new_group(backend="gradientflow")
        backend = backend_of(group)
        defaults = backend.config
        grads = [torch.randn(s) for s in gradient_shapes(model)][::-1]  # backward order

        def step() -> float:
            t0 = time.perf_counter()
            works = [dist.all_reduce(g, group=group, async_op=True) for g in grads]
            for w in works:
                w.wait()
            return time.perf_counter() - t0

        t0 = time.perf_counter()
        tune = Tuner(group, **tuner)
        while not tune.done:
            step()
            tune.step()
        tune_s = time.perf_counter() - t0
        names = list(tune.defaults)
        chosen = {k: getattr(backend.config, k) for k in names}
        variants = {DEFAULT: {k: getattr(defaults, k) for k in names}, AUTOTUNE: chosen,
                    **{_label(p): p for p in grid}}

        def alternate(keys: list[str], n: int) -> dict[str, list[float]]:
            """`n` reps of every variant in `keys`, order rotated per rep: ms per rep."""
            got: dict[str, list[float]] = {k: [] for k in keys}
            for rep in range(n):
                for k in keys[rep % len(keys):] + keys[:rep % len(keys)]:
                    backend.reconfigure(defaults.replace(**variants[k]))
                    step()  # warm-up: new segments, new routes
                    got[k].append(1e3 * median([step() for _ in range(steps)]))
            return got

        reps_ms = alternate(list(variants), reps)
        # The grid's winner (rank 0's times, so every rank switches to the same one), then a
        # head-to-head on new reps: picked and compared on the same reps, the minimum of a
        # dozen noisy medians would be biased low by the noise alone.
        pick = [best_grid(reps_ms, list(range(reps)))]
        dist.broadcast_object_list(pick, src=0, group=group)
        h2h_ms = alternate([AUTOTUNE, pick[0], DEFAULT], h2h) if h2h else {}
        out[model] = {"tensors": len(grads), "bytes": sum(g.numel() * 4 for g in grads),
                      "tune_steps": tune.calls, "tune_s": tune_s, "chosen": chosen,
                      "summary": tune.summary, "variants": variants, "reps_ms": reps_ms,
                      "ms": {k: median(v) for k, v in reps_ms.items()},
                      "best_grid": pick[0], "h2h_ms": h2h_ms}
        dist.destroy_process_group(group)
    return out


def _launch_on(rate: float | None, n: int, kwargs: dict, notes: list) -> object | None:
    """One launch on loopback (rate None) or the emulated network; None where not emulated."""
    target = "benchmarks.bench_autotune:worker"
    if rate is None:
        return launch(target, world_size=n, kwargs=kwargs, timeout_s=3000)
    with Cluster(n, ShapeConfig(rate_gbps=rate)) as cluster:
        if not cluster.shaped:
            notes.append(f"{_tier_label(rate)} not emulated ({cluster.reason}): skipped")
            return None
        return launch(target, world_size=n, kwargs=kwargs, cluster=cluster, timeout_s=3000)


def best_grid(reps_ms: dict[str, list[float]], reps: list[int]) -> str:
    """The grid point with the lowest median over `reps` (indices into each variant's reps)."""
    grid = [k for k in reps_ms if k not in (DEFAULT, AUTOTUNE)]
    return min(grid, key=lambda k: median([reps_ms[k][i] for i in reps]))


def _row(tier: str, n: int, model: str, r: dict) -> dict:
    ms, reps_ms, best = r["ms"], r["reps_ms"], r["best_grid"]
    h2h = dict(r["h2h_ms"] or reps_ms)  # the head-to-head reps (the grid's without them)
    same = r["chosen"] == r["variants"][DEFAULT]
    if same:
        # Autotune kept the defaults: the two series time one setting, so each rep's mean of
        # the two is that setting's time (their difference is the noise, not a choice).
        both = [(a + d) / 2 for a, d in zip(h2h[AUTOTUNE], h2h[DEFAULT])]
        h2h[AUTOTUNE] = h2h[DEFAULT] = both
    vs_best = paired_ratio([h2h[AUTOTUNE]], [h2h[best]])
    vs_best_all = paired_ratio([reps_ms[AUTOTUNE]], [reps_ms[best]])
    gain = paired_ratio([h2h[DEFAULT]], [h2h[AUTOTUNE]])
    s = r["summary"] or {}
    return {"tier": tier, "ranks": n, "model": model, "tune steps": r["tune_steps"],
            "default ms": median(h2h[DEFAULT]), "autotune ms": median(h2h[AUTOTUNE]),
            "best grid ms": median(h2h[best]), "grid-phase best ms": ms[best],
            "autotune / best grid": f"{vs_best[0]:.3f} [{vs_best[1]:.2f}, {vs_best[2]:.2f}]",
            "within 5%": "yes" if vs_best[0] <= 1.05 else "no",
            "same-rep best": f"{vs_best_all[0]:.3f}",
            "gain over defaults": f"{gain[0] - 1:+.1%} [{gain[1] - 1:+.0%}, {gain[2] - 1:+.0%}]",
            "own estimate": f"{s.get('gain', float('nan')):+.1%}" if s else "-",
            "kept defaults": "yes" if same else "no",
            "chosen": _label(r["chosen"]), "best grid": best,
            "mattered most": (max(s["importance"], key=s["importance"].get)
                              if s.get("importance") else "-")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/autotune")
    ap.add_argument("--worlds", default=None, help="rank counts, e.g. 2,4")
    ap.add_argument("--models", default=None, help="e.g. resnet50,alexnet,bert-base")
    ap.add_argument("--tiers", default=None, help="emulated Gbit/s besides loopback: none,10")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant and rep")
    ap.add_argument("--h2h", type=int, default=None,
                    help="head-to-head reps of autotune, the grid's best and the defaults")
    ap.add_argument("--trials", type=int, default=None, help="autotune trials (default 12)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        models, worlds, reps, tiers = ["tiny"], [2], 3, [None]
        tuner = {"trials": 4, "steps": 2, "warmup": 1, "confirm": 1, "finalists": 2}
    else:
        models, worlds, reps, tiers = ["resnet50", "alexnet", "bert-base"], [2], 5, [None]
        # 12 trials of 1 + 4 steps, then 2 race rounds of 3 candidates: 90 steps (+1).
        tuner = {"trials": 12, "steps": 4, "warmup": 1, "confirm": 2, "finalists": 2}
    tuner["seed"] = args.seed
    if args.trials:
        tuner["trials"] = args.trials
    models = args.models.split(",") if args.models else models
    worlds = [int(w) for w in args.worlds.split(",")] if args.worlds else worlds
    if args.tiers:
        tiers = [None if t.strip().lower() in ("none", "loopback", "") else float(t)
                 for t in args.tiers.split(",")]
    reps = args.reps or reps
    grid = grid_points(args.quick)
    h2h = args.h2h if args.h2h is not None else (3 if args.quick else 8)
    kwargs = {"models": models, "grid": grid, "reps": reps, "tuner": tuner,
              "steps": args.steps, "h2h": h2h}
    rows, raw, notes = [], {}, []
    start = _when()
    for rate, n in itertools.product(tiers, worlds):
        res = _launch_on(rate, n, kwargs, notes)
        if res is None:
            continue
        if not res.ok:
            print(res.error)
            return 1
        raw[f"{_tier_label(rate)} {n}"] = res.results[0]
        rows += [_row(_tier_label(rate), n, model, r) for model, r in res.results[0].items()]
    cols = list(rows[0].keys()) if rows else []
    md = (f"## Autotune against a grid of the same settings (median ms per step: the whole "
          f"gradient list, one async allreduce per tensor)\n\n{machine_line()} The "
          f"machine's 1-minute load average was {start[1]:.2f} at the start (2 cores; the "
          "benchmark's own ranks load it too).\n\n"
          f"Autotune: {tuner}; grid: {len(grid)} points (fusion x solo x cycle, 2 segments). "
          f"After tuning, defaults, autotune's choice and the grid were timed alternately "
          f"over {reps} reps (each the median of {args.steps} steps after 1 discarded warm-up "
          "step), switching one group with reconfigure(). The grid's best point (lowest "
          f"median there) then met autotune's choice and the defaults head to head in {h2h} "
          "more alternated reps: 'default ms', 'autotune ms', 'best grid ms', 'autotune / best "
          "grid' and 'gain over defaults' come from those reps; the bracketed ranges are 95% "
          "bootstrap intervals of the paired per-rep ratios (benchmarks/common.py, "
          "paired_ratio). 'same-rep best': the ratio in the grid phase's own reps, where the "
          "best point was picked (leans high: the minimum of many noisy medians). 'own "
          "estimate': the gain autotune measured itself (its race rounds). Where autotune kept the "
          "defaults, its series and the defaults' time one setting: each rep's mean of the two "
          "stands for both (the gain is then 0 by construction).\n\n"
          + markdown_table(cols, rows) + "".join(f"\n- {x}" for x in notes))
    print(md)
    write_result(args.out, "autotune", {"rows": rows, "raw": raw, "notes": notes,
                                        "tuner": tuner, "grid": grid}, md)
    # start and end with the load: the matrix (autotune_matrix.py) reports both per launch
    with open(os.path.join(args.out, "log.txt"), "w") as f:
        for what, (utc, load) in (("start", start), ("end", _when())):
            f.write(f"{what}: {utc}  load average: {load:.2f}\n")
    return 0


def _when() -> tuple[str, float]:
    """The UTC time of day and the machine's 1-minute load average, now."""
    import time

    return time.strftime("%H:%M:%S", time.gmtime()), os.getloadavg()[0]


if __name__ == "__main__":
    sys.exit(main())
