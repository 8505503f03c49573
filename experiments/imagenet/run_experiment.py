"""Dense FP32 vs FP16 vs CSC on real handwritten digits, 2 CPU ranks: accuracy and wire bytes.

    # `make experiment`: 5 settings x 3 seeds, ~25 min
    python experiments/imagenet/run_experiment.py
    # `make demo`: CSC 1%, one seed, 6 epochs, ~2-3 min
    python experiments/imagenet/run_experiment.py --demo
    # a quick look
    python experiments/imagenet/run_experiment.py --settings dense csc-1% --seeds 0 --epochs 2
    # DDP on gloo against the default CSC recipe on an emulated 1 Gbps switch (root: namespaces)
    python experiments/imagenet/run_experiment.py --settings ddp-gloo csc-default --link-gbps 1 \
        --out experiments/imagenet/results/1gbps

Every run is `torchrun --standalone --nproc-per-node 2 train.py ...` with the same seed, schedule
and data order; only the gradient communication differs. With --link-gbps each rank runs
train.py in its own network namespace behind a tbf-shaped link into a bridge
(benchmarks/netem.py), with torchrun's environment set by hand. Runs go seed by seed, every
setting at one seed before the next seed, so that a drift in the machine's load hits the
settings alike. The per-epoch JSON lines of every run are gathered into OUT/results.md (a table,
with the training time to --target-top1 and its ratio to DDP on gloo), OUT/summary.json and the
plots OUT/top1.png, OUT/loss.png, OUT/bytes.png.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
import hvd_launch  # noqa: E402
import provenance  # noqa: E402
from prepare import DEFAULT_OUT as DIGITS, DataUnavailable, prepare, prepare_fashion  # noqa: E402
from sweep import DIGITS_RECIPE as RECIPE, launch, read_log  # noqa: E402

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
# PowerSGD rank 4, torch's hook and the engine's, and the DDP variants they are timed in.
TORCH_PSGD4 = ["--compression", "powersgd", "--powersgd-rank", "4"]
GF_PSGD4 = ["--compression", "gf-powersgd", "--powersgd-rank", "4"]
ONE_BUCKET = ["--bucket-cap-mb", "1024"]
OWN_GROUP = ["--compression-group", "gradientflow"]  # DDP on gloo, compression on its own group
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
    # The default with DGC's momentum correction switched on (the former default).
    "csc-default-mc": ("GradientFlow CSC 1% default + momentum correction",
                       ["--compression", "csc", "--density", "0.01", "--momentum-correction"]),
    # The library's default recipe, nothing else set.
    "csc-default": ("GradientFlow CSC 1% default", ["--compression", "csc", "--density", "0.01"]),
    "gf-fp16": ("GradientFlow FP16", ["--compression", "fp16"]),
    # The peers a user would pick instead, each as its users run it. torch's hooks on DDP over
    # gloo; PowerSGD with torch's recommended start (plain allreduce for the first 10% of the
    # steps), error feedback and warm start on.
    "torch-fp16": ("DDP + torch fp16_compress_hook", ["--compression", "torch-fp16"]),
    "powersgd-2": ("DDP + PowerSGD rank 2", ["--compression", "powersgd", "--powersgd-rank", "2"]),
    "powersgd-4": ("DDP + PowerSGD rank 4", TORCH_PSGD4),
    # The same in one DDP bucket: torch's hook on gloo aborts the job when a model has several
    # ("Received data size doesn't match": its buckets' allreduces overtake each other).
    "powersgd-4-1b": ("DDP + PowerSGD rank 4, one bucket", TORCH_PSGD4 + ONE_BUCKET),
    # The same method on GradientFlow's engine (compression/powersgd.py): the same rank, start
    # step and FP32 wire, its factors fused and agreed like every other batch.
    "gf-powersgd-4": ("GradientFlow PowerSGD rank 4", GF_PSGD4),
    # Both in one bucket, and torch's hook on the gradientflow backend (its allreduces checked
    # and routed like any program's): which part of a difference is the method's, which the
    # backend's. One bucket: the layout in which torch's hook also runs on gloo.
    "powersgd-4-1b-gf": ("DDP + PowerSGD rank 4, one bucket, on gradientflow",
                         TORCH_PSGD4 + ONE_BUCKET),
    "gf-powersgd-4-1b": ("GradientFlow PowerSGD rank 4, one bucket", GF_PSGD4 + ONE_BUCKET),
    # DDP on gloo, only the compressed traffic on a gradientflow group of its own
    # (hooks.register's process_group): DDP's buffer broadcast before each forward is then
    # gloo's, which a root only sends, where a checked round makes it wait for the other rank.
    "gf-powersgd-4-side": ("GradientFlow PowerSGD rank 4, DDP on gloo", GF_PSGD4 + OWN_GROUP),
    "csc-default-side": ("GradientFlow CSC 1% default, DDP on gloo",
                         ["--compression", "csc", "--density", "0.01"] + OWN_GROUP),
    # Horovod 0.28.1 (make horovod): its DistributedOptimizer, no DDP, Gloo between the ranks.
    "horovod": ("Horovod 0.28.1", ["--horovod", "--compression", "none"]),
    "horovod-fp16": ("Horovod 0.28.1 + Compression.fp16", ["--horovod", "--compression", "fp16"]),
    # The same with the chunks chosen over the pool of a fused batch, not a quota per bucket.
    "csc-pool": ("CSC 1% default, pool selection",
                 ["--compression", "csc", "--density", "0.01", "--selection", "pool"]),
    # FSDP2 (fully_shard per top-level block, train.py --fsdp): its own reduce-scatter, and the
    # same model registered with the CSC default (a CSC all-reduce of each group's gradient).
    "fsdp-dense": ("FSDP2 dense", ["--fsdp", "--compression", "none"]),
    "fsdp-csc": ("FSDP2 + GradientFlow CSC 1% default",
                 ["--fsdp", "--compression", "csc", "--density", "0.01"]),
    # Plain DDP: dense FP32 over torch's own gloo process group, whatever --dist-backend says.
    "ddp-gloo": ("DDP gloo dense FP32", ["--compression", "none"]),
    # DDP with a hook that sends nothing: no setting can step faster. The ranks do not average,
    # so its accuracy is not comparable; its epoch times bound every speed-up (time_table).
    "nocomm": ("no communication (time bound; ranks do not average)",
               ["--compression", "noop"]),
}
# The setting whose epoch times bound the speed-up over BASELINE.
LIMIT = "nocomm"
# Settings that always run on one transport (the others take --dist-backend).
TRANSPORT = {"ddp-gloo": "gloo", "torch-fp16": "gloo", "powersgd-2": "gloo", "powersgd-4": "gloo",
             "powersgd-4-1b": "gloo", "horovod": "gloo", "horovod-fp16": "gloo",
             "gf-powersgd-4-side": "gloo", "csc-default-side": "gloo"}
# Settings whose ranks run in the Horovod environment, started as horovodrun would.
HOROVOD = ("horovod", "horovod-fp16")
# The peers of the Fashion-MNIST comparison (compare.py), in table order; GradientFlow's CSC
# default is the one measured against the best of the others.
PEERS = ["ddp-gloo", "torch-fp16", "powersgd-2", "powersgd-4", "horovod", "horovod-fp16",
         "gf-fp16", "csc-default"]
OURS = "csc-default"
# What a plain run (no --settings) runs.
DEFAULT_SETTINGS = ["dense", "fp16", "csc-10%", "csc-1%", "csc-0.1%", "csc-1%-mc", "csc-default"]
# The baseline of the time-to-accuracy ratio, and the accuracy reference when "dense" did not run.
BASELINE = "ddp-gloo"

# One schedule for every setting (RECIPE, shared with the sweep): ResNet-18 (torchvision,
# unchanged) on 32x32 upscaled digits, global batch 64 (32 per rank), SGD momentum 0.9, cosine LR
# from 0.05 after a one-epoch warm-up.

# Fashion-MNIST: global batch 128, SGD momentum 0.9, weight decay 5e-4, learning rate 0.05;
# "plain" keeps it constant (what a new user starts with), "schedule" warms it up over half
# an epoch and decays it by a cosine to 0. Shifts of up to 2 pixels and horizontal flips.
FASHION_RECIPES = {
    "plain": ["--lr-schedule", "constant"],
    "schedule": ["--lr-schedule", "cosine", "--lr-warmup-epochs", "0.5"],
}
FASHION_COMMON = ["--num-classes", "10", "-b", "128", "--lr", "0.05", "--lr-base-batch", "128",
                  "--momentum", "0.9", "--wd", "5e-4", "--augment", "imagenet", "-j", "0",
                  "--no-checkpoint"]
DATA_TITLES = {
    "digits": "Digits (scikit-learn, 1437 train / 360 val), ResNet-18 at 32x32",
    "fashion-mnist": "Fashion-MNIST (60,000 train / 10,000 test, 28x28), {arch}",
}


def data_args(data: str, arch: str | None = None, recipe: str = "plain") -> list:
    """train.py's data, model and recipe arguments (the setting's come after them)."""
    if data == "digits":
        args = [str(prepare()), *RECIPE]
        if arch:
            args[args.index("-a") + 1] = arch
        return args
    return [str(prepare_fashion()), "-a", arch or "alexnet_shaped", *FASHION_COMMON,
            *FASHION_RECIPES[recipe]]


def run_one(
    key: str, seed: int, epochs: int, out: Path, nproc: int, backend: str, timeout: float,
    link_gbps: float | None = None, lock: Path | None = None, common: list | None = None,
) -> Path:
    """Train one (setting, seed) and return its JSON-lines log.

    link_gbps: run the ranks on an emulated switch of this rate (else torchrun on loopback;
    Horovod's ranks always start as horovodrun would, on loopback without root).
    common: train.py's data, model and recipe arguments (default: the digits recipe).
    lock: hold an exclusive flock on this file during the run, so that timing runs of other
    jobs on the machine do not overlap it. The machine's load average before and after, the
    wall time and the link go to LOGS/<key>-seed<s>.meta.json.
    """
    stem = out / "logs" / f"{key}-seed{seed}"
    log, console = stem.with_name(stem.name + ".jsonl"), stem.with_name(stem.name + ".out")
    backend = TRANSPORT.get(key, backend)
    args = [*(common or [str(DIGITS), *RECIPE]), *SETTINGS[key][1], "--epochs", str(epochs),
            "--seed", str(seed), "--dist-backend", backend]
    with held(lock):
        load_before = os.getloadavg()
        started, commit = provenance.utc_now(), provenance.commit()
        t0 = time.perf_counter()
        try:
            if link_gbps is None and key not in HOROVOD:
                launch(args, log, console, nproc, timeout)
            else:
                launch_shaped(args, log, console, nproc, timeout, link_gbps,
                              horovod=key in HOROVOD)
        except RuntimeError as exc:
            raise RuntimeError(f"run {key} seed {seed} failed ({exc})") from None
        wall = time.perf_counter() - t0
        load_after = os.getloadavg()
    meta = {"setting": key, "seed": seed, "transport": backend, "link_gbps": link_gbps,
            "nproc": nproc, "wall_s": round(wall, 1), "loadavg_before": load_before,
            "loadavg_after": load_after, "args": args, "started_utc": started,
            "ended_utc": provenance.utc_now(), "commit": commit,
            "host": provenance.host(), **provenance.run_fields(read_log(log))}
    stem.with_name(stem.name + ".meta.json").write_text(json.dumps(meta) + "\n")
    print(f"  {SETTINGS[key][0]:<12} seed {seed}: {wall:5.1f} s, "
          f"top-1 {read_log(log)[-1]['val_top1']:.2f}, load {load_before[0]:.1f} -> "
          f"{load_after[0]:.1f}", flush=True)
    return log


@contextlib.contextmanager
def held(lock: Path | None):
    """An exclusive flock on `lock` for the duration of the block (nothing when None)."""
    if lock is None:
        yield
        return
    with open(lock, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _repo_on_path() -> None:
    """Make the checkout's `benchmarks` package importable (this script runs by path)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


def launch_shaped(train_args: list, log: Path, console: Path, nproc: int, timeout: float,
                  link_gbps: float | None, horovod: bool = False) -> None:
    """Run train.py's ranks on an emulated switch: one namespace per rank, tbf at `link_gbps`.

    link_gbps None: unshaped namespaces as root, else loopback (Horovod's runs, which always
    start here). horovod: the ranks run in the Horovod environment's python, with Horovod's
    rendezvous server in rank 0's namespace and horovodrun's variables (hvd_launch.py).

    torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) is set per
    rank, with gloo bound to the rank's shaped NIC. Every rank is killed when the time limit
    passes or shortly after one rank fails (the others would wait on a collective forever); the
    namespaces are removed in every case. Raises RuntimeError naming the failed rank.
    """
    _repo_on_path()
    from benchmarks.launch import _kill, free_port
    from benchmarks.netem import Cluster, NetemUnavailable, ShapeConfig

    log.parent.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)
    base = dict(os.environ, OMP_NUM_THREADS="1")  # ranks share the cores: one thread each
    base["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p])
    outputs = [console.with_name(f"{console.stem}.rank{r}.tmp") for r in range(nproc)]
    procs, server = [], None
    python = str(hvd_launch.HOROVOD_PYTHON) if horovod else sys.executable
    try:
        with Cluster(nproc, ShapeConfig(rate_gbps=link_gbps),
                     allow_fallback=link_gbps is None) as cluster:
            port = free_port()
            if horovod:
                hosts = [cluster.addr(r) for r in range(nproc)]
                server, hvd_port = hvd_launch.start_server(cluster.wrap(0, []), hosts, base)
            for rank, path in enumerate(outputs):
                argv = cluster.wrap(rank, [python, str(HERE / "train.py"), *train_args,
                                           "--json-log", str(log)])
                env = cluster.env(rank, port, base)
                if horovod:
                    env.update(hvd_launch.rank_env(rank, hosts, cluster.master_addr, hvd_port,
                                                   cluster.ifname))
                with open(path, "w") as fh:
                    procs.append(subprocess.Popen(argv, env=env, cwd=REPO, stdout=fh,
                                                  stderr=subprocess.STDOUT,
                                                  start_new_session=True))
            failed = wait_ranks(procs, timeout)
            for p in procs:
                _kill(p)
            if server is not None:
                server.stdin.close()
                _kill(server)
    except NetemUnavailable as exc:
        raise RuntimeError(f"cannot emulate a {link_gbps:g} Gbps link ({exc}); run as root, or "
                           f"leave out --link-gbps to run on loopback") from None
    finally:
        for p in procs + ([server] if server is not None else []):
            _kill(p)
        texts = [path.read_text(errors="replace") if path.exists() else "" for path in outputs]
        console.write_text("".join(f"==== rank {r} ====\n{t}" for r, t in enumerate(texts)))
        for path in outputs:
            path.unlink(missing_ok=True)
    if failed is not None:
        rank, why = failed
        lines = texts[rank].strip().splitlines()
        errors = [line for line in lines if "Error" in line or "error:" in line]
        raise RuntimeError(f"rank {rank} {why}: {(errors or lines or ['no output'])[-1].strip()}")


def wait_ranks(procs: list, timeout: float, grace: float = 10.0):
    """Wait for every rank; None when all exit 0, else (rank, why) of the first to fail.

    Stops waiting at `timeout` seconds, or `grace` seconds after the first failure
    (benchmarks.launch.wait_ranks).
    """
    _repo_on_path()
    from benchmarks.launch import wait_ranks as wait

    failed, timed_out = wait(procs, timeout, grace)
    if failed is not None:
        return failed, f"exited with code {procs[failed].poll()}"
    if timed_out:
        return next(r for r, p in enumerate(procs) if p.poll() is None), \
            f"timed out after {timeout:.0f} s"
    return None


def epoch_at_top1(log: list, target: float) -> int | None:
    """The first epoch whose val top-1 reaches `target` (percent); None when none does."""
    return next((r["epoch"] for r in log if r["val_top1"] >= target), None)


def time_to_top1(log: list, target: float) -> float | None:
    """Training wall time until the first epoch whose val top-1 reaches `target` (percent).

    The sum of the epochs' train_time_s up to and including that epoch (validation, the same
    for every setting, is left out); None when no epoch reaches it.
    """
    elapsed = 0.0
    for record in log:
        elapsed += record["train_time_s"]
        if record["val_top1"] >= target:
            return elapsed
    return None


def run_order(settings: list, seeds: list) -> list:
    """(setting, seed) pairs seed by seed: every setting at one seed before the next seed, so
    that a drift in the machine's load during the batch hits every setting alike."""
    return [(key, seed) for seed in seeds for key in settings]


def finished(out: Path, key: str, seed: int, epochs: int, link_gbps: float | None) -> bool:
    """Whether (key, seed) already has a log of every epoch, run on the same link."""
    log = out / "logs" / f"{key}-seed{seed}.jsonl"
    meta = read_meta(out, key, seed)
    return (log.exists() and bool(meta) and meta.get("link_gbps") == link_gbps
            and [r["epoch"] for r in read_log(log)] == list(range(epochs)))


def positive(text: str) -> float:
    """argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0 (Gbit/s)")
    return value


def backend_of(out: Path, key: str, seeds: list) -> str:
    """The transport the runs of a setting used, read back from their console output."""
    found = set()
    for seed in seeds:
        path = out / "logs" / f"{key}-seed{seed}.out"
        m = re.search(r"dist_backend=(\w+)", path.read_text()) if path.exists() else None
        found.add(m.group(1) if m else "?")
    return "/".join(sorted(found))


def read_meta(out: Path, key: str, seed: int) -> dict:
    """What run_one recorded about a run (wall time, load average, link); {} for older runs."""
    path = out / "logs" / f"{key}-seed{seed}.meta.json"
    return json.loads(path.read_text()) if path.exists() else {}


def summarise(runs: dict, backends: dict | None = None, target: float = 97.0,
              metas: dict | None = None) -> dict:
    """Per setting: final top-1 over seeds, steady and whole-run wire bytes per step, images/s,
    training time to `target` top-1 per seed and, where BASELINE ran, its ratio to BASELINE's."""
    summary = {}
    for key, logs in runs.items():
        # The test set's top-1 where a run read it once at the end (--report-test), else the
        # last epoch's score (on the test set without --val-split).
        finals = [log[-1].get("test_top1", log[-1]["val_top1"]) for log in logs]
        steady = statistics.median(log[-1]["wire_bytes_per_step"] for log in logs)
        dense = statistics.median(log[-1]["dense_bytes_per_step"] for log in logs)
        whole = statistics.median(
            sum(r["wire_bytes"] for r in log) / sum(r["steps"] for r in log) for log in logs
        )
        nic = [log[-1]["nic_tx_bytes"] / log[-1]["steps"] for log in logs
               if log[-1].get("nic_tx_bytes") is not None]
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
            "top5_mean": statistics.mean(log[-1].get("test_top5", log[-1]["val_top5"])
                                         for log in logs),
            "wire_bytes_per_step_steady": steady,
            "wire_bytes_per_step_run": whole,
            "dense_bytes_per_step": dense,
            # What rank 0's NIC sent per step in the last epoch (emulated switch only): every
            # byte on the wire, whoever counted what, the peers' protocols included.
            "nic_bytes_per_step": statistics.median(nic) if nic else None,
            "images_per_s": ips,
            "comm_s_per_epoch": statistics.median(r["comm_s"] for log in logs for r in log),
            "density_final": logs[0][-1].get("density"),
            "per_epoch": {
                m: [statistics.mean(log[e][m] for log in logs) for e in range(len(logs[0]))]
                for m in ("val_top1", "train_loss", "val_loss", "wire_bytes_per_step")
            },
            "target_top1": target,
            "time_to_target_s": [time_to_top1(log, target) for log in logs],
            "epoch_at_target": [epoch_at_top1(log, target) for log in logs],
            "train_time_s": [sum(r["train_time_s"] for r in log) for log in logs],
            "epoch_times_s": [[r["train_time_s"] for r in log] for log in logs],
            "runs": (metas or {}).get(key, []),
        }
    base = summary.get(BASELINE, {})
    for s in summary.values():
        s["speedup_vs_baseline"] = (speedups(base["time_to_target_s"], s["time_to_target_s"])
                                    if base else None)
        # Speed alone, whatever the accuracy: the baseline's whole-run training time over this.
        s["run_speedup_vs_baseline"] = (statistics.mean(base["train_time_s"])
                                        / statistics.mean(s["train_time_s"]) if base else None)
    return summary


def speedups(base: list, times: list) -> dict:
    """BASELINE's time to target over this setting's: per seed and of the means over seeds.

    A run that never reached the target gives None for its seed, and the mean then covers the
    runs that did (with how many in "reached").
    """
    per_seed = [b / t if b and t else None for b, t in zip(base, times)]
    reached_b, reached_t = [b for b in base if b], [t for t in times if t]
    of_means = (statistics.mean(reached_b) / statistics.mean(reached_t)
                if reached_b and reached_t else None)
    return {"per_seed": per_seed, "of_means": of_means, "reached": len(reached_t)}


def markdown(
    summary: dict, epochs: int, seeds: list, nproc: int, backend: str, command: str,
    link_gbps: float | None = None, timed: bool = True, title: str = DATA_TITLES["digits"],
    unavailable: dict | None = None,
) -> str:
    reference = "dense" if "dense" in summary else BASELINE
    dense_top1 = summary.get(reference, {}).get("top1_mean")
    network = (f", emulated {link_gbps:g} Gbps switch (one namespace per rank, tbf both ways)"
               if link_gbps else "")
    lines = [
        f"## {title}, {nproc} CPU ranks{network}",
        "",
        f"{epochs} epochs, seeds {', '.join(map(str, seeds))}; "
        f"final top-1 as mean ± standard deviation over seeds "
        f"(min-max); wire bytes are what one rank hands to allreduce per step "
        f"(values and chunk norms); "
        f"'steady' is the last epoch, 'run' the whole-run average with the warm-up. "
        + ("One val image = 0.28 points." if title.startswith("Digits") else
           "One test image = 0.01 points."),
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
    for key, why in (unavailable or {}).items():
        lines.append(f"| {SETTINGS[key][0]} | did not run: {why} |" + " |" * 8)
    if dense_top1 is not None and reference != "dense":
        lines += ["", f"Δ vs dense: against {summary[reference]['label']}."]
    if not timed:
        lines += ["", "Accuracy only: these runs were not timing runs (low priority, no lock), so "
                  "the time to target is left out and images/s and comm s/epoch mean nothing."]
    elif any(s["runs"] for s in summary.values()):
        lines += [""] + time_table(summary)
    lines += ["", f"Command: `{command}`", ""]
    return "\n".join(lines)


def time_table(summary: dict) -> list:
    """Markdown lines: training time to the target top-1 per seed, the ratio to BASELINE, load."""
    target = next(iter(summary.values()))["target_top1"]
    base = summary.get(BASELINE, {}).get("label", BASELINE)
    lines = [
        f"Training time to {target:g}% val top-1 (sum of the epochs' train_time_s up to the "
        f"first epoch at or above it; validation left out), and {base}'s time over this "
        f"setting's (higher: sooner). 'of means': mean time of {base} over the mean time of "
        f"the setting. Load: the machine's 1-minute load average at the start and end of each "
        f"run (2 cores).",
        "",
        "| setting | time to target per seed (s, @epoch) | mean (s) | speed-up vs DDP gloo per "
        "seed | of means | whole-run train time, mean (s) | whole-run speed-up "
        "| load average per run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, s in summary.items():
        if key == LIMIT:  # its ranks do not average: only its epoch times count (the bound)
            continue
        times = [f"{t:.0f} @{e}" if t else "not reached"
                 for t, e in zip(s["time_to_target_s"], s["epoch_at_target"])]
        reached = [t for t in s["time_to_target_s"] if t]
        up = s["speedup_vs_baseline"] or {}
        per_seed = ", ".join(f"{x:.2f}x" if x else "-" for x in up.get("per_seed", []))
        of_means = f"{up['of_means']:.2f}x" if up.get("of_means") else "-"
        loads = ", ".join(f"{r['loadavg_before'][0]:.1f}-{r['loadavg_after'][0]:.1f}"
                          for r in s["runs"])
        mean = f"{statistics.mean(reached):.0f}" if reached else "-"
        run_up = s.get("run_speedup_vs_baseline")
        lines.append(f"| {s['label']} | {', '.join(times)} | {mean} | {per_seed or '-'} "
                     f"| {of_means} | {statistics.mean(s['train_time_s']):.0f} | "
                     f"{f'{run_up:.2f}x' if run_up else '-'} | {loads or '-'} |")
    bound = speedup_bound(summary)
    if bound is not None:
        seeds = ", ".join(f"{x:.2f}x" for x in bound["per_seed"])
        lines += ["", f"The bound: {summary[LIMIT]['label'].split(' (')[0]} trains "
                  f"{bound['s_per_epoch']:.1f} s per epoch (median, epochs 1 on). Over the "
                  f"epochs {base} needed to reach {target:g}%, it takes {bound['of_means']:.2f}x "
                  f"less time than {base} (per seed {seeds}): "
                  f"a setting that converged as fast as {base} and communicated in no time at "
                  f"all would reach the target that much sooner, and no sooner."]
    return lines


def speedup_bound(summary: dict) -> dict | None:
    """How much sooner than BASELINE the target can be reached at all: BASELINE's time to it over
    LIMIT's time for the same epochs, seed by seed. None unless both ran and BASELINE reached it.

    LIMIT's epoch times are what a step costs with no communication; the epochs are BASELINE's
    (dense convergence, which no compressor beats).
    """
    base, limit = summary.get(BASELINE), summary.get(LIMIT)
    if not base or not limit or not limit.get("epoch_times_s"):
        return None
    per_seed, bases, limits = [], [], []
    for t, e, times in zip(base["time_to_target_s"], base["epoch_at_target"],
                           limit["epoch_times_s"]):
        if t and e is not None and e < len(times):
            bases.append(t)
            limits.append(sum(times[: e + 1]))
            per_seed.append(t / limits[-1])
    if not per_seed:
        return None
    steady = [x for times in limit["epoch_times_s"] for x in times[1:]]
    return {"per_seed": per_seed, "of_means": statistics.mean(bases) / statistics.mean(limits),
            "s_per_epoch": statistics.median(steady or limit["epoch_times_s"][0])}


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
    p.add_argument("--link-gbps", type=positive, default=None, metavar="GBPS",
                   help="run each rank in its own network namespace behind a link of this rate "
                   "(tbf, both directions; needs root) instead of torchrun on loopback")
    p.add_argument("--lock", type=Path, default=None, metavar="FILE",
                   help="hold an exclusive flock on FILE during each run (not between runs), so "
                   "that timing runs of other jobs sharing the machine do not overlap one")
    p.add_argument("--target-top1", type=float, default=97.0,
                   help="val top-1 (%%) whose training time to reach is reported")
    p.add_argument("--accuracy-only", action="store_true", help="the runs are not timing runs "
                   "(e.g. run at low priority beside others): the table leaves times out")
    p.add_argument("--keep", action="store_true", help="do not run again a (setting, seed) "
                   "whose log has every epoch and whose meta file names the same link")
    p.add_argument("--data", choices=["digits", "fashion-mnist"], default="digits",
                   help="the data set (fashion-mnist: prepare.py installs and unpacks it)")
    p.add_argument("--arch", default=None, help="train.py's -a (digits: resnet18; "
                   "fashion-mnist: alexnet_shaped)")
    p.add_argument("--recipe", choices=list(FASHION_RECIPES), default="plain",
                   help="fashion-mnist: constant learning rate (plain) or warm-up + cosine")
    p.add_argument("--train-args", default="", help="more train.py arguments for every run "
                   "(after the recipe's, so they win), e.g. '--steps-per-epoch 40'")
    args = p.parse_args(argv)
    settings = args.settings or (["csc-1%-mc"] if args.demo else DEFAULT_SETTINGS)
    seeds = args.seeds or ([0] if args.demo else [0, 1, 2])
    epochs = args.epochs or (6 if args.demo else 8)
    out = args.out or (HERE / "runs" / "demo" if args.demo else HERE / "results")
    out.mkdir(parents=True, exist_ok=True)
    command = "python experiments/imagenet/run_experiment.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )

    try:
        common = data_args(args.data, args.arch, args.recipe) + shlex.split(args.train_args)
    except DataUnavailable as exc:
        print(f"run_experiment.py: error: {exc}", file=sys.stderr)
        return 2
    # A peer that cannot run here is reported in the table with the reason, not left out.
    unavailable = {}
    if any(k in HOROVOD for k in settings) and not args.no_run:
        why = hvd_launch.horovod_unavailable()
        unavailable = {k: why for k in settings if k in HOROVOD and why}
    if args.no_run and (out / "unavailable.json").exists():
        unavailable = json.loads((out / "unavailable.json").read_text())
    settings = [k for k in settings if k not in unavailable]
    t0 = time.perf_counter()
    print(
        f"{len(settings)} settings x {len(seeds)} seeds, {epochs} epochs each, "
        f"{args.nproc} ranks -> {out}",
        flush=True,
    )
    try:
        for key, s in run_order(settings, seeds):
            if args.no_run or (args.keep and finished(out, key, s, epochs, args.link_gbps)):
                continue
            try:
                run_one(key, s, epochs, out, args.nproc, args.dist_backend, args.timeout,
                        args.link_gbps, args.lock, common)
            except RuntimeError as exc:
                if key not in PEERS or key == OURS:
                    raise
                unavailable[key] = str(exc)  # a peer that fails is reported, the rest go on
        settings = [k for k in settings if k not in unavailable]
        runs = {key: [read_log(out / "logs" / f"{key}-seed{s}.jsonl") for s in seeds]
                for key in settings}
    except (RuntimeError, FileNotFoundError) as exc:
        print(f"run_experiment.py: error: {exc}; logs in {out / 'logs'}", file=sys.stderr)
        return 1
    metas = {key: [m for s in seeds if (m := read_meta(out, key, s))] for key in settings}
    summary = summarise(runs, {key: backend_of(out, key, seeds) for key in runs},
                        args.target_top1, metas)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    title = DATA_TITLES[args.data].format(arch=args.arch or "alexnet_shaped")
    if args.data == "fashion-mnist":
        title += f", {args.recipe} recipe"
    table = markdown(summary, epochs, seeds, args.nproc, args.dist_backend, command.strip(),
                     args.link_gbps, timed=not args.accuracy_only, title=title,
                     unavailable=unavailable)
    (out / "unavailable.json").write_text(json.dumps(unavailable, indent=2) + "\n")
    (out / "results.md").write_text(table)
    plots = plot(runs, summary, out)
    print(table)
    print_verdict(summary, time.perf_counter() - t0, out, plots, epochs, seeds, args.nproc,
                  title)
    return 0


def print_verdict(
    summary: dict, elapsed: float, out: Path, plots: list, epochs: int, seeds: list, nproc: int,
    title: str = DATA_TITLES["digits"],
) -> None:
    """The at-a-glance ending: accuracy, speed, bytes, where things are."""
    print(f"\n=== GradientFlow: {title}, {nproc} CPU ranks, {epochs} epochs, "
          f"{len(seeds)} seed(s), {elapsed / 60:.1f} min ===")
    held_out = "360 held-out" if title.startswith("Digits") else "10,000 test"
    print(f"  (top-1 on {held_out} images; "
          "bytes = what each rank sends per step once warm-up is over)")
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
