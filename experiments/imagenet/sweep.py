"""Density x chunk-size sweep of CSC on real data: accuracy, wire bytes, speed, a recommendation.

    python experiments/imagenet/run_experiment.py --densities 0.1,0.03,0.01,0.003,0.001 \\
        --chunk-sizes 256,1024,4096 --seeds 0,1,2 --link-gbps 1,10,56

Every run is one `torchrun ... train.py` launch with the same model, schedule and data order;
only the gradient communication differs. Each run writes OUT/logs/<key>-seed<s>.jsonl (one JSON
line per epoch) and OUT/logs/<key>-seed<s>.meta.json (the exact train.py arguments). A run whose
log holds every epoch and whose meta file names the same arguments is finished and is not run
again, so an interrupted sweep resumes where it stopped. From the logs the sweep writes
OUT/sweep.md (the table and the recommendations), OUT/sweep.json and OUT/pareto.png.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from protocol import VAL_SPLITS

HERE = Path(__file__).resolve().parent
# Where prepare.py writes the built-in digits, below any checkout.
BUILTIN_DATA_SUFFIX = "experiments/imagenet/data/digits"


# --------------------------------------------------------------------------------------------
# The grid.
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, order=True)
class Setting:
    """One way of sending gradients: dense FP32, FP16, or CSC at (density, chunk size)."""

    method: str                    # "dense", "fp16" or "csc"
    density: float = 1.0
    chunk_size: int | None = None  # elements per chunk (CSC only)

    @property
    def key(self) -> str:
        """File-name stem of this setting's logs, e.g. csc-d0.01-c1024."""
        if self.method != "csc":
            return self.method
        return f"csc-d{self.density:g}-c{self.chunk_size}"

    @property
    def label(self) -> str:
        if self.method == "dense":
            return "dense FP32"
        if self.method == "fp16":
            return "FP16"
        return f"CSC {100 * self.density:g}% c{self.chunk_size}"

    def train_args(self) -> list:
        """train.py flags that select this setting (the recipe comes from the caller)."""
        if self.method == "dense":
            return ["--compression", "none"]
        if self.method == "fp16":
            return ["--compression", "fp16", "--wire-dtype", "fp16"]
        return ["--compression", "csc", "--density", f"{self.density:g}",
                "--chunk-size", str(self.chunk_size)]


def parse_list(text: str, kind: str) -> list:
    """Parse a comma list of densities, chunk sizes or seeds; ValueError says what is wrong.

    kind: "density" (floats in (0, 1]), "chunk" (ints >= 1), "seed" (ints >= 0) or "link"
    (Gbit/s, floats > 0). Duplicates are dropped, order is kept.
    """
    items = [s.strip() for s in str(text).split(",") if s.strip()]
    if not items:
        raise ValueError(f"empty {kind} list {text!r}: give comma-separated values, e.g. "
                         + {"density": "0.1,0.01", "chunk": "256,1024", "seed": "0,1,2",
                            "link": "1,10,56"}[kind])
    out = []
    for item in items:
        try:
            value = float(item) if kind in ("density", "link") else int(item)
        except ValueError:
            raise ValueError(f"{kind} {item!r} in {text!r} is not a number") from None
        if kind == "density" and not (0.0 < value <= 1.0):
            raise ValueError(f"density {item} must lie in (0, 1] (the fraction of chunks sent)")
        if kind == "chunk" and value < 1:
            raise ValueError(f"chunk size {item} must be a positive number of elements")
        if kind == "link" and not (0.0 < value < math.inf):
            raise ValueError(f"link speed {item} must be a positive number of Gbit/s")
        if kind == "seed" and value < 0:
            raise ValueError(f"seed {item} must be >= 0")
        if value not in out:
            out.append(value)
    return out


def build_grid(densities: list, chunk_sizes: list, *, full: bool = False,
               reference_density: float = 0.01, reference_chunk: int = 1024,
               baselines: bool = True) -> list:
    """Settings of the sweep, baselines first.

    full: every (density, chunk size) pair. Otherwise a cross through the reference point:
    every density at the reference chunk size (or the first chunk size given, if the reference
    is not among them) and every chunk size at the reference density (likewise): the two
    one-dimensional cuts a user tunes, at a third of the full grid's cost.
    """
    if full:
        pairs = [(d, c) for c in chunk_sizes for d in densities]
    else:
        c0 = reference_chunk if reference_chunk in chunk_sizes else chunk_sizes[0]
        d0 = reference_density if reference_density in densities else densities[0]
        pairs = [(d, c0) for d in densities] + [(d0, c) for c in chunk_sizes if c != c0]
    grid = [Setting("dense"), Setting("fp16")] if baselines else []
    return grid + [Setting("csc", d, c) for d, c in pairs]


# --------------------------------------------------------------------------------------------
# Running, and resuming from the logs.
# --------------------------------------------------------------------------------------------
def log_paths(out: Path, setting: Setting, seed: int) -> tuple:
    """(epoch log, meta file, console output) of one run."""
    stem = out / "logs" / f"{setting.key}-seed{seed}"
    return (stem.with_name(stem.name + ".jsonl"), stem.with_name(stem.name + ".meta.json"),
            stem.with_name(stem.name + ".out"))


def read_log(path: Path) -> list:
    """The per-epoch records of a JSON-lines log (a torn last line is ignored)."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def finished(out: Path, setting: Setting, seed: int, train_args: list, epochs: int) -> bool:
    """Whether this run's log is complete and was written by the same train.py arguments."""
    log, meta, _ = log_paths(out, setting, seed)
    if not (log.is_file() and meta.is_file()):
        return False
    try:
        recorded = json.loads(meta.read_text()).get("train_args")
    except json.JSONDecodeError:
        return False
    records = read_log(log)
    return (_portable(recorded) == _portable(train_args)
            and [r.get("epoch") for r in records] == list(range(epochs)))


def _portable(train_args) -> list | None:
    """The arguments with the built-in digits' path, which names the checkout, made neutral:
    logs committed from one clone are reused in another."""
    if not isinstance(train_args, list):
        return None
    return ["<digits>" if str(a).endswith(BUILTIN_DATA_SUFFIX) else a for a in train_args]


def launch(train_args: list, log: Path, console: Path, nproc: int, timeout: float) -> None:
    """Run train.py under torchrun with `train_args` (+ --json-log LOG); raise on failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(HERE / "train.py"), *train_args, "--json-log", str(log)]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # ranks share the cores: one thread each
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        console.write_text(f"{exc}\n")
        raise RuntimeError(f"timed out after {timeout:.0f} s") from None
    console.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        # The ranks' own error, not torchrun's summary of it.
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        errors = [line for line in lines if ("Error" in line or "error:" in line)
                  and "ChildFailedError" not in line and "errors.html" not in line]
        reason = (errors or lines or ["no output"])[-1].strip()
        raise RuntimeError(f"exit {proc.returncode}: {reason}")


def run_grid(grid: list, seeds: list, common_args: list, epochs: int, out: Path, *,
             nproc: int = 2, timeout: float = 1800, csc_args: list = (), extra_args: list = (),
             jobs: int = 1, progress: bool = True, launcher=launch) -> dict:
    """Run every (setting, seed) whose log is not finished; return {(key, seed): error}.

    Seed-major order: an interrupted sweep has every setting at the first seeds. Runs that fail
    are recorded and skipped (the next call retries them). One tqdm bar counts the runs.
    jobs: runs at a time (each is its own torchrun; they share the machine's cores).
    """
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from tqdm import tqdm

    runs = [(s, seed) for seed in seeds for s in grid]
    args_of = {(s, seed): run_args(s, seed, common_args, epochs, csc_args, extra_args)
               for s, seed in runs}
    todo = [j for j in runs if not finished(out, *j, args_of[j], epochs)]
    failures = {}
    (out / "logs").mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(runs), initial=len(runs) - len(todo), desc="sweep", unit="run",
               disable=not progress, dynamic_ncols=True, file=sys.stdout)

    def one(setting: Setting, seed: int) -> float:
        log, meta, console = log_paths(out, setting, seed)
        meta.unlink(missing_ok=True)
        t0 = time.perf_counter()
        launcher(args_of[setting, seed], log, console, nproc, timeout)
        meta.write_text(json.dumps({"train_args": args_of[setting, seed], "nproc": nproc,
                                    "wall_s": round(time.perf_counter() - t0, 1)}) + "\n")
        return time.perf_counter() - t0

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        pending = {pool.submit(one, *job): job for job in todo}
        for done in as_completed(pending):
            setting, seed = pending[done]
            try:
                wall = done.result()
            except RuntimeError as exc:
                failures[setting.key, seed] = str(exc)
                bar.write(f"  {setting.label} seed {seed} failed: {exc} "
                          f"(see {log_paths(out, setting, seed)[2]})")
            else:
                last = read_log(log_paths(out, setting, seed)[0])[-1]
                bar.write(f"  {setting.label:<18} seed {seed}: top-1 {last['val_top1']:6.2f}  "
                          f"{wall:5.0f} s")
            bar.set_postfix_str(f"last: {setting.label} seed {seed}")
            bar.update(1)
    bar.close()
    return failures


def run_args(setting: Setting, seed: int, common_args: list, epochs: int, csc_args: list = (),
             extra_args: list = ()) -> list:
    """The full train.py argument list of one run (what its meta file records).

    extra_args come last, so that they override the recipe (argparse keeps the last value).
    """
    recipe = list(csc_args) if setting.method == "csc" else []
    return [*common_args, *setting.train_args(), *recipe, *extra_args, "--epochs", str(epochs),
            "--seed", str(seed)]


# --------------------------------------------------------------------------------------------
# The command line.
# --------------------------------------------------------------------------------------------
# The model and schedule of every run on the built-in digits (see README.md): ResNet-18 on 32x32
# upscaled digits, global batch 64, SGD momentum 0.9, cosine LR from 0.05 after one epoch of
# linear warm-up. Only the gradient communication differs between runs.
DIGITS_RECIPE = ["-a", "resnet18", "--image-size", "32", "--num-classes", "10",
                 "--augment", "light", "-b", "64", "--lr", "0.05", "--lr-base-batch", "64",
                 "--lr-schedule", "cosine", "--lr-warmup-epochs", "1", "--wd", "5e-4", "-j", "0",
                 "--no-checkpoint"]
# The paper's CSC recipe (DGC's momentum correction, a dense first warm-up stage, warm-up counted
# in steps: 1, 0.25, 0.0625, 0.0156 for 3 steps each) and an FP16 wire. Spelled out so that the
# sweep's numbers do not depend on the library's defaults (momentum correction is not one).
CSC_RECIPE = ["--wire-dtype", "fp16", "--momentum-correction", "--warmup", "1,0.25,0.0625,0.015625",
              "--warmup-unit", "step", "--warmup-period", "3"]


def parse_args(argv=None):
    import argparse

    p = argparse.ArgumentParser(prog="run_experiment.py", description=__doc__.splitlines()[0])
    p.add_argument("data", nargs="?", default=None,
                   help="an ImageFolder root with train/ and val/ (default: the built-in digits)")
    p.add_argument("--densities", default="0.1,0.03,0.01,0.003,0.001", help="comma list in (0, 1]")
    p.add_argument("--chunk-sizes", default="256,1024,4096",
                   help="comma list of elements per chunk")
    p.add_argument("--seeds", default="0,1,2", help="comma list")
    p.add_argument("--full-grid", action="store_true", help="every (density, chunk size) pair, "
                   "not only every density at the reference chunk size and every chunk size at "
                   "the reference density")
    p.add_argument("--reference-density", default=0.01, type=float)
    p.add_argument("--reference-chunk-size", default=1024, type=int)
    p.add_argument("--epochs", default=6, type=int, help="epochs per run")
    p.add_argument("--val-split", default=None, type=int, metavar="N",
                   help="training images held out as the validation split the recommendation "
                   "ranks (default: 360 on the built-in digits, none on other data, which then "
                   "gets no recommendation)")
    p.add_argument("-a", "--arch", default=None, help="model (default: the recipe's resnet18)")
    p.add_argument("--train-args", default="", help="extra train.py flags for every run, one "
                   "string; they come last, so they override the recipe's")
    p.add_argument("--nproc", default=2, type=int, help="ranks per run (CPU processes or GPUs)")
    p.add_argument("--dist-backend", default="gradientflow")
    p.add_argument("--timeout", default=1800, type=float, help="seconds allowed per run")
    p.add_argument("--jobs", default=1, type=int, help="runs at a time (they share the cores)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "sweep", help="results folder")
    p.add_argument("--no-run", action="store_true", help="only report from OUT/logs")
    p.add_argument("--link-gbps", default="1,10,56", help="link speeds to recommend a setting for")
    p.add_argument("--within", default=10.0, type=float,
                   help="recommend the most accurate setting whose predicted step time is within "
                        "this many percent of the fastest")
    p.add_argument("--ranks", default=None, type=int,
                   help="ranks the step-time prediction assumes (default --nproc)")
    p.add_argument("--latency-us", default=0.0, type=float,
                   help="per-allreduce-message latency the prediction adds, in microseconds")
    return p.parse_args(argv)


def common_train_args(args) -> list:
    """train.py flags shared by every run: data, model, schedule, transport."""
    if args.data is None:
        from prepare import prepare

        recipe = [str(prepare())] + DIGITS_RECIPE
    else:
        classes = [d for d in (Path(args.data) / "train").iterdir() if d.is_dir()]
        recipe = [str(args.data), *DIGITS_RECIPE[:2], "--num-classes", str(len(classes)),
                  "-b", "256", "--lr", "0.1", "--lr-base-batch", "256", "--lr-schedule", "cosine",
                  "--lr-warmup-epochs", "1", "-j", "4", "--no-checkpoint"]
    if args.arch:
        recipe[recipe.index("-a") + 1] = args.arch
    split = args.val_split if args.val_split is not None else (
        VAL_SPLITS["digits"] if args.data is None else 0)
    if split:  # choices rank the validation split, never the test set (protocol.py)
        recipe += ["--val-split", str(split)]
    return recipe + ["--dist-backend", args.dist_backend]


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        densities = parse_list(args.densities, "density")
        chunks = parse_list(args.chunk_sizes, "chunk")
        seeds = parse_list(args.seeds, "seed")
        links = parse_list(args.link_gbps, "link")
    except ValueError as exc:
        print(f"run_experiment.py: error: {exc}", file=sys.stderr)
        return 2
    grid = build_grid(densities, chunks, full=args.full_grid,
                      reference_density=args.reference_density,
                      reference_chunk=args.reference_chunk_size)
    common = common_train_args(args)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{len(grid)} settings x {len(seeds)} seeds, {args.epochs} epochs each, "
          f"{args.nproc} ranks -> {args.out}", flush=True)
    failures = {}
    if not args.no_run:
        failures = run_grid(grid, seeds, common, args.epochs, args.out, nproc=args.nproc,
                            timeout=args.timeout, csc_args=CSC_RECIPE,
                            extra_args=shlex.split(args.train_args), jobs=args.jobs)
    from sweep_report import report

    report(grid, seeds, args, links, common + shlex.split(args.train_args), CSC_RECIPE)
    if failures:
        print(f"{len(failures)} run(s) failed; run the same command again to retry them",
              file=sys.stderr)
        return 1
    return 0
