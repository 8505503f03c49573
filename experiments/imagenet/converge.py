"""Accuracy at convergence on held-out seeds: `make converge` (Fashion-MNIST) and
`make converge DATA=digits`.

    python experiments/imagenet/converge.py                      # both models, every setting
    python experiments/imagenet/converge.py --data digits        # the held-out data set
    python experiments/imagenet/converge.py --jobs 2             # two runs at a time
    python experiments/imagenet/converge.py --no-run             # only the report from the logs
    python experiments/imagenet/converge.py --quick              # 2 epochs of 4 steps: machinery

Each model trains with warm-up + cosine for --epochs (30) on 2 CPU ranks over loopback
(accuracy does not depend on the link), under every setting of SETTINGS, on the report seeds
10-14 that no choice saw (protocol.py). Every epoch is scored on the validation split held out
of the training set; the test set is read once, after the last epoch (--report-test). Runs go
seed by seed (every setting at one seed before the next), several at once with --jobs; a run
whose log is complete and whose arguments match is kept, so an interrupted stage goes on where
it stopped. The report (converge_report.py) is OUT/results.md and OUT/summary.json.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import converge_report  # noqa: E402
import protocol  # noqa: E402
import run_experiment as rx  # noqa: E402

# DDP, the CSC default, the CSC default with momentum correction, torch's FP16 hook, PowerSGD
# rank 4: the default against its former self and the peers a user would pick. Digits' ResNet-18
# (44.7 MB of gradient) fills two DDP buckets, where torch's PowerSGD hook on gloo aborts the job
# (it did at epoch 7 of seed 10): it runs in one bucket there, and the engine's PowerSGD, which
# takes DDP's buckets as they are, beside it.
SETTINGS = {"fashion-mnist": ["ddp-gloo", "csc-default", "csc-default-mc", "torch-fp16",
                              "powersgd-4"],
            "digits": ["ddp-gloo", "csc-default", "csc-default-mc", "torch-fp16",
                       "powersgd-4-1b", "gf-powersgd-4"]}
MODELS = {"fashion-mnist": ["alexnet_shaped", "resnet_shaped"], "digits": ["resnet18"]}
OUTS = {"fashion-mnist": HERE / "results" / "fashion-converged",
        "digits": HERE / "results" / "digits-converged"}


def train_args(data: str, model: str, extra: list) -> list:
    """train.py's data, model and recipe arguments for one model: warm-up + cosine, the
    validation split, the test set read once at the end."""
    recipe = "schedule" if data == "fashion-mnist" else "plain"  # digits: cosine already
    return [*rx.data_args(data, model, recipe), "--val-split", str(protocol.VAL_SPLITS[data]),
            "--report-test", *extra]


def portable(args: list) -> list:
    """Arguments with paths inside the checkout made relative to it: logs committed from one
    clone are kept in another."""
    root = str(rx.REPO) + "/"
    return [a[len(root):] if isinstance(a, str) and a.startswith(root) else a for a in args]


def done(folder: Path, key: str, seed: int, epochs: int, args: list) -> bool:
    """Whether (key, seed) has a log of every epoch with a test evaluation, made with `args`."""
    if not rx.finished(folder, key, seed, epochs, None):
        return False
    meta = rx.read_meta(folder, key, seed)
    log = rx.read_log(folder / "logs" / f"{key}-seed{seed}.jsonl")
    want = [*args, *rx.SETTINGS[key][1], "--epochs", str(epochs), "--seed", str(seed)]
    return "test_top1" in log[-1] and portable(meta.get("args", []))[:len(want)] == portable(want)


def plan(models: list, settings: list, seeds: list) -> list:
    """(model, setting, seed) in run order: seed by seed, and within a seed every model and
    setting, so that an interrupted stage has every setting at the first seeds."""
    return [(m, key, seed) for seed in seeds for m in models for key in settings]


def run_stage(out: Path, data: str, models: list, settings: list, seeds: list, epochs: int,
              jobs: int, timeout: float, extra: list, runner=rx.run_one,
              lock: Path | None = None) -> dict:
    """Run every unfinished (model, setting, seed); return {(model, key, seed): error}."""
    todo = []
    for model, key, seed in plan(models, settings, seeds):
        args = train_args(data, model, extra)
        if not done(out / model, key, seed, epochs, args):
            todo.append((model, key, seed, args))
    print(f"{len(todo)} of {len(models) * len(settings) * len(seeds)} runs to go, {jobs} at a "
          f"time -> {out}", flush=True)
    failures = {}

    def one(job):
        model, key, seed, args = job
        try:
            runner(key, seed, epochs, out / model, 2, "gradientflow", timeout, None, lock, args)
        except RuntimeError as exc:
            failures[(model, key, seed)] = str(exc)
            print(f"  {model} {key} seed {seed}: {exc}", file=sys.stderr, flush=True)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(one, todo))  # map keeps the order in which the runs start
    return failures


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", choices=list(MODELS), default="fashion-mnist")
    p.add_argument("--models", nargs="+", default=None, help="default: the data set's models")
    p.add_argument("--settings", nargs="+", default=None, choices=list(rx.SETTINGS),
                   help="default: the data set's settings")
    p.add_argument("--seeds", nargs="+", type=int, default=list(protocol.REPORT_SEEDS))
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (they share the cores)")
    p.add_argument("--timeout", type=float, default=4 * 3600, help="seconds allowed per run")
    p.add_argument("--out", type=Path, default=None, help="default: results/<data>-converged")
    p.add_argument("--baseline", default=converge_report.BASELINE, choices=list(rx.SETTINGS),
                   help="the setting every other is paired with (default: DDP)")
    p.add_argument("--title", default=None, help="the report's heading")
    p.add_argument("--lock", type=Path, default=None,
                   help="hold an exclusive flock on this file during each run (a stage whose "
                   "ms/step is compared: other timing jobs wait between runs, not inside one)")
    p.add_argument("--train-args", default="", help="more train.py flags for every run")
    p.add_argument("--quick", action="store_true",
                   help="2 epochs of 4 steps, one seed: checks the machinery, not the result")
    p.add_argument("--no-run", action="store_true", help="only the report from OUT's logs")
    args = p.parse_args(argv)
    try:  # a report of logs already made (--no-run) may name the seeds they were made on
        if not args.no_run:
            protocol.check_role("report", args.seeds)
    except protocol.ProtocolError as exc:
        p.error(str(exc))
    models = args.models or MODELS[args.data]
    args.settings = args.settings or SETTINGS[args.data]
    extra = shlex.split(args.train_args)
    if args.quick:
        args.epochs, args.seeds = 2, args.seeds[:1]
        extra += ["--steps-per-epoch", "4"]
    out = args.out or OUTS[args.data]
    command = "python experiments/imagenet/converge.py " + " ".join(map(shlex.quote, argv))
    t0 = time.perf_counter()
    failures = {}
    if not args.no_run:
        try:
            failures = run_stage(out, args.data, models, args.settings, args.seeds, args.epochs,
                                 args.jobs, args.timeout, extra, lock=args.lock)
        except rx.DataUnavailable as exc:
            print(f"converge.py: error: {exc}", file=sys.stderr)
            return 2
    text = converge_report.write(out, args.data, models, args.settings, args.seeds, args.epochs,
                                 command.strip(), args.baseline, args.title)
    print(text)
    print(f"{(time.perf_counter() - t0) / 60:.1f} min; {out / 'results.md'}")
    if failures:
        print(f"{len(failures)} run(s) failed; the same command runs them again",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
