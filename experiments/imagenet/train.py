"""Train a torchvision model on ImageNet (or any ImageFolder) with GradientFlow's compressed DDP.

The flags of pytorch/examples' imagenet/main.py are kept as they are (data, -a/--arch, -j,
--epochs, --start-epoch, -b, --lr, --momentum, --wd, -p, --resume, -e, --seed, --dist-backend,
--dummy); ours sit beside them. `-b` is the GLOBAL batch (all ranks together); `--lr` is the rate
for a batch of `--lr-base-batch` images and is scaled linearly to `-b` (Goyal et al. 2017).

One process (CPU or one GPU; a one-rank process group on a free local port):
    python experiments/imagenet/train.py --dummy -a resnet18 -b 32 --steps-per-epoch 10 --epochs 1

One node, 8 GPUs (or 2 CPU ranks), CSC at 1% density with an FP16 wire:
    torchrun --standalone --nproc-per-node 8 experiments/imagenet/train.py /data/imagenet \\
        -a resnet50 -b 2048 --lr 0.1 --compression csc --density 0.01 --wire-dtype fp16 \\
        --warmup 4 --amp --json-log runs/r50.jsonl

Two nodes (run on each node; NODE0 is any address every node can reach):
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint NODE0:29400 \\
        --rdzv-id r50 experiments/imagenet/train.py /data/imagenet -a resnet50 -b 4096 \\
        --lr 0.1 --lr-warmup-epochs 5 --compression csc --density 0.01 --wire-dtype fp16

The built-in small real data set (see prepare.py and README.md):
    python experiments/imagenet/prepare.py
    torchrun --standalone --nproc-per-node 2 experiments/imagenet/train.py \\
        experiments/imagenet/data/digits -a resnet18 --image-size 32 --num-classes 10 \\
        --augment light -b 64 --lr 0.05 --lr-base-batch 64 --lr-schedule cosine \\
        --lr-warmup-epochs 1 --wd 5e-4 -j 0 --epochs 8 --compression csc --density 0.01 \\
        --momentum-correction --warmup 3 --warmup-unit step --warmup-period 3
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import re
import signal
import socket
import sys
import time
import zlib
from pathlib import Path

import torch

import gradientflow  # registers the backend; stats() and mark_step() for the logs
import torch.distributed as dist
import torch.nn as nn
import torchvision.models as tv_models
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import ARCHS, SHAPED  # noqa: E402  (models.py sits beside this script)
import protocol  # noqa: E402  (the validation split and the report seeds)
import provenance  # noqa: E402  (CPU by thread, for the logs)

PROG = "train.py"
# The four IDX files torchvision's FashionMNIST reads from ROOT/FashionMNIST/raw/, uncompressed.
FASHION_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                 "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
# Fashion-MNIST's pixel mean and standard deviation over its 60,000 training images (0-1 scale).
FASHION_MEAN, FASHION_STD = 0.2860, 0.3530


# --------------------------------------------------------------------------------------------
# Command line and configuration: resolved once, validated before any process group exists.
# --------------------------------------------------------------------------------------------
class ConfigError(ValueError):
    """Bad input: reported as one line, exit code 2, before init_process_group."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage block
        raise ConfigError(message)


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(
        prog=PROG,
        description="Train a torchvision model with GradientFlow (see the module docstring).",
    )
    # --- pytorch/examples imagenet/main.py flags, names and meanings kept ---
    p.add_argument(
        "data",
        nargs="?",
        default="imagenet",
        help="dataset root: an ImageFolder with train/ and val/, or a folder holding "
        "FashionMNIST/raw/ (prepare.py --dataset fashion-mnist)",
    )
    p.add_argument(
        "-a",
        "--arch",
        default="resnet18",
        help="torchvision.models classification model "
        "name, or alexnet_bn (AlexNet with batch normalisation, the large-batch variant)",
    )
    p.add_argument(
        "-j",
        "--workers",
        default=4,
        type=int,
        help="DataLoader workers per rank (started by forkserver/spawn)",
    )
    p.add_argument("--epochs", default=90, type=int, help="number of total epochs to run")
    p.add_argument(
        "--start-epoch", default=0, type=int, help="manual epoch number (useful on restarts)"
    )
    p.add_argument(
        "-b",
        "--batch-size",
        default=256,
        type=int,
        help="global mini-batch size, all ranks together",
    )
    p.add_argument(
        "--lr",
        "--learning-rate",
        default=0.1,
        type=float,
        dest="lr",
        help="LR for --lr-base-batch images",
    )
    p.add_argument("--momentum", default=0.9, type=float)
    p.add_argument("--wd", "--weight-decay", default=1e-4, type=float, dest="weight_decay")
    p.add_argument(
        "-p", "--print-freq", default=10, type=int, help="progress-bar refresh, in steps"
    )
    p.add_argument(
        "--resume",
        default="",
        type=str,
        help="path to checkpoint.pth.tar; 'auto': the one in "
        "--checkpoint-dir if it exists (what a torchrun --max-restarts restart needs), "
        "else from scratch",
    )
    p.add_argument(
        "-e", "--evaluate", action="store_true", help="evaluate on the validation set and exit"
    )
    p.add_argument("--seed", default=None, type=int, help="seed for initialisation and data order")
    p.add_argument(
        "--dist-backend",
        default="gradientflow",
        help="torch.distributed backend (gradientflow, gloo, nccl)",
    )
    p.add_argument("--dummy", action="store_true", help="use fake data to benchmark")
    # --- GradientFlow: compression and transport ---
    p.add_argument("--compression", default="none",
                   choices=["none", "fp16", "csc", "gf-powersgd", "noop", "torch-fp16",
                            "powersgd"],
                   help="gradient compression in the DDP comm hook: gradientflow's fp16, csc and "
                   "PowerSGD (gf-powersgd, FP32 wire, --powersgd-rank and --powersgd-start-iter "
                   "as torch's); torch's own fp16_compress_hook (torch-fp16) and PowerSGD "
                   "(powersgd); noop, "
                   "a hook that sends nothing, each rank stepping on its own gradients: the "
                   "no-communication time bound, not a way to train. With --horovod: none or "
                   "fp16, Horovod's Compression.none or .fp16")
    p.add_argument("--powersgd-rank", default=2, type=int,
                   help="PowerSGD: matrix_approximation_rank (default 2)")
    p.add_argument("--powersgd-start-iter", default=None, type=int,
                   help="PowerSGD: steps of plain allreduce before compression starts (default: "
                   "10%% of the run's steps, at least 2, as torch's PowerSGDState recommends)")
    p.add_argument("--compression-group", default="ddp", choices=["ddp", "gradientflow"],
                   help="where gradientflow's compressed traffic goes: DDP's own process group "
                   "(ddp, the default) or a gradientflow group of its own (gradientflow): DDP "
                   "then keeps --dist-backend (gloo) for everything else, its buffer broadcast "
                   "before each forward included")
    p.add_argument("--horovod", action="store_true",
                   help="average gradients with Horovod's DistributedOptimizer instead of DDP, as "
                   "Horovod's users do (horovod must be importable: make horovod builds it into "
                   ".venv-horovod; the ranks need Horovod's gloo environment, see "
                   "run_experiment.py)")
    p.add_argument("--fsdp", action="store_true",
                   help="shard the model with FSDP2's fully_shard (each top-level block, then the "
                   "root) instead of DDP; --compression none, fp16 or csc (gradientflow.hooks."
                   "register on the sharded model); needs --no-checkpoint")
    p.add_argument(
        "--density",
        default=0.01,
        type=float,
        help="CSC: fraction of chunks sent per step, in (0, 1]",
    )
    p.add_argument(
        "--chunk-size",
        default=None,
        type=int,
        help="CSC: elements per chunk (default: the library's)",
    )
    p.add_argument(
        "--min-numel",
        default=None,
        type=int,
        help="CSC: tensors with fewer elements than this are sent dense every step "
        "(default: the library's)",
    )
    p.add_argument(
        "--wire-dtype",
        default=None,
        choices=["fp32", "fp16", "bf16"],
        help="dtype of the values on the wire (default: fp16 for fp16, the library's for csc)",
    )
    # The CSC recipe flags default to None: unset, the library's own defaults apply.
    p.add_argument(
        "--warmup",
        default=None,
        help="CSC dense warm-up: N stages of DGC's decaying density "
        "(0.25, 0.0625, 0.0156, 0.0039; never below --density), a comma list of densities, or none "
        "(default: the library's)",
    )
    p.add_argument("--warmup-unit", default=None, choices=["epoch", "step"],
                   help="what one warm-up stage counts (default: the library's)")
    p.add_argument("--warmup-period", default=None, type=int,
                   help="epochs (or steps) per warm-up stage (default: the library's)")
    p.add_argument("--momentum-correction", default=None, action=argparse.BooleanOptionalAction,
                   help="CSC: DGC momentum correction: the hook takes SGD's --momentum into the "
                   "compressor (default: the library's, off)")
    p.add_argument("--selection", default=None, choices=["pool", "bucket"],
                   help="CSC: choose the top chunks across every bucket of a fused batch (pool) "
                   "or a quota per DDP bucket (bucket) (default: the library's)")
    p.add_argument("--clip-norm", default=None, type=float,
                   help="CSC: DGC's local gradient clipping, the L2 bound of the summed gradient "
                   "(default: none)")
    p.add_argument(
        "--fusion-threshold",
        default=None,
        help="lazy-allreduce fusion threshold, e.g. 64MB (passed to the gradientflow backend as "
        "pg_options). It applies to compressed traffic too: FP16/CSC buckets queued together "
        "are fused into one op (CSC: two collectives for the batch) up to this many dense "
        "bytes; 0 sends every bucket alone",
    )
    p.add_argument(
        "--bucket-cap-mb",
        default=25.0,
        type=float,
        help="DDP bucket size in MB (a compressed unit)",
    )
    # --- training recipe ---
    p.add_argument(
        "--amp", action="store_true", help="mixed precision (fp16+GradScaler on CUDA, bf16 on CPU)"
    )
    p.add_argument(
        "--lr-base-batch",
        default=256,
        type=int,
        help="batch size that --lr is meant for (linear scaling)",
    )
    p.add_argument(
        "--lr-warmup-epochs",
        default=0.0,
        type=float,
        help="linear LR warm-up from 0 (large batches: 5)",
    )
    p.add_argument("--lr-schedule", default="step", choices=["step", "cosine", "constant"],
                   help="after the warm-up: x0.1 at each --lr-steps epoch, cosine to 0, or "
                   "constant")
    p.add_argument(
        "--lr-steps",
        default="30,60",
        help="step schedule: epochs where the LR is multiplied by 0.1",
    )
    p.add_argument(
        "--lars",
        action="store_true",
        help="LARS layer-wise trust ratio (You et al. 2017) for huge batches",
    )
    p.add_argument("--lars-eta", default=0.001, type=float)
    p.add_argument("--label-smoothing", default=0.0, type=float)
    # --- data and model shape ---
    p.add_argument("--dataset", default="auto", choices=["auto", "imagefolder", "fashion-mnist"],
                   help="how `data` is read: an ImageFolder, or Fashion-MNIST through "
                   "torchvision's FashionMNIST class (auto: Fashion-MNIST when data holds "
                   "FashionMNIST/raw/)")
    p.add_argument("--image-size", default=None, type=int,
                   help="training crop side in pixels (default 224; Fashion-MNIST: 28, its own)")
    p.add_argument("--num-classes", default=1000, type=int)
    p.add_argument("--augment", default="imagenet", choices=["imagenet", "light", "none"],
                   help="imagenet: RandomResizedCrop+flip; light: small crop jitter, no flip; none")
    p.add_argument("--val-split", default=0, type=int, metavar="N",
                   help="hold N training images out as a validation split scored every epoch "
                   "(protocol.py); 0: every epoch is scored on the test set, as before")
    p.add_argument("--report-test", action="store_true",
                   help="with --val-split: score the test set once, after the last epoch, into "
                   "its own fields (test_top1, ...); refused on screening seeds 0-9")
    p.add_argument(
        "--steps-per-epoch",
        default=0,
        type=int,
        help="cap on train (and val) steps per epoch; 0 = all",
    )
    # --- output ---
    p.add_argument(
        "--json-log",
        default=None,
        dest="log",
        help="append one JSON line per epoch to this file "
        "(not --log: torchrun would take it for an abbreviation of its own --log-dir)",
    )
    p.add_argument(
        "--checkpoint-dir",
        default=".",
        help="where checkpoint.pth.tar (+ one shard per rank) is written",
    )
    p.add_argument("--no-checkpoint", action="store_true", help="do not write checkpoints")
    # --- fault injection (tests and benchmarks/soak.py only) ---
    p.add_argument("--fault-kill-at-step", default=-1, type=int, metavar="N",
                   help="the last rank SIGKILLs itself before global step N, in the first torchrun "
                   "attempt only (TORCHELASTIC_RESTART_COUNT 0): tests restarts with --resume auto")
    return p.parse_args(argv)


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything the run needs, resolved once from the command line and the launcher's env."""

    # data and model
    data: str
    dataset: str              # "imagefolder" or "fashion-mnist" (resolved from "auto")
    dummy: bool
    arch: str
    num_classes: int
    image_size: int
    augment: str
    workers: int
    # schedule
    epochs: int
    start_epoch: int
    steps_per_epoch: int      # 0: the whole data set
    val_split: int            # images held out of training and scored every epoch; 0: none
    report_test: bool         # score the test set once, after the last epoch
    batch_size: int           # global
    per_rank_batch: int       # batch_size / world_size
    peak_lr: float            # lr * batch_size / lr_base_batch
    lr_warmup_epochs: float
    lr_schedule: str
    lr_steps: tuple
    momentum: float
    weight_decay: float
    lars: bool
    lars_eta: float
    label_smoothing: float
    amp: bool
    seed: int | None
    # distribution and compression
    world_size: int
    rank: int
    local_rank: int
    dist_backend: str
    compression: str
    compression_config: object  # gradientflow.compression.CompressionConfig, or None for "none"
    powersgd_rank: int
    powersgd_start_iter: int | None  # None: 10% of the run's steps (resolved once steps are known)
    horovod: bool
    fsdp: bool
    backend_options: dict | None  # gradientflow options for init_process_group's pg_options
    compression_group: str  # "ddp" or "gradientflow" (--compression-group)
    bucket_cap_mb: float
    # output
    resume: str
    evaluate: bool
    print_freq: int
    log: str | None
    checkpoint_dir: str
    checkpoint: bool
    fault_kill_at_step: int   # -1: no fault injected


def dataset_kind(data: str, choice: str) -> str:
    """--dataset resolved: "auto" reads Fashion-MNIST where `data` holds FashionMNIST/raw/."""
    if choice != "auto":
        return choice
    fashion = os.path.isdir(os.path.join(data, "FashionMNIST", "raw"))
    return "fashion-mnist" if fashion else "imagefolder"


def dgc_warmup(spec: str, target: float) -> tuple:
    """Parse --warmup into per-epoch densities: "N" -> DGC's 0.25 * 4**-k for k < N (>= target)."""
    spec = spec.strip()
    if spec in ("none", ""):
        return ()
    if re.fullmatch(r"\d+", spec):
        return tuple(0.25 * 4.0 ** -k for k in range(int(spec)))  # the library keeps them >= target
    try:
        values = tuple(float(v) for v in spec.split(",") if v.strip())
    except ValueError:
        raise ConfigError(
            f"--warmup {spec!r} is neither a number of epochs nor a comma list of densities"
        )
    if not all(0.0 < v <= 1.0 for v in values):
        raise ConfigError(f"--warmup densities must lie in (0, 1], got {spec!r}")
    return values


def build_compression_config(args, warmup: tuple):
    """Turn our flags into gradientflow.compression.CompressionConfig (which validates them)."""
    try:
        from gradientflow.compression import CompressionConfig
        from gradientflow.hooks import register  # noqa: F401  (checked here, used after init)
    except ImportError as exc:
        raise ConfigError(
            f"--compression {args.compression} is waiting on gradientflow.hooks.register and "
            f"gradientflow.compression.CompressionConfig ({exc}); use --compression none for now"
        )
    # Only what the user set is passed: the rest is the library's default recipe.
    kwargs = dict(method=args.compression, wire_dtype=args.wire_dtype or "fp16")
    if args.compression == "gf-powersgd":
        # torch's hook at the same rank is the peer: its FP32 wire, its start rule (the start
        # step is set once the run's steps are known, build_ddp).
        kwargs = dict(method="powersgd", wire_dtype=args.wire_dtype or "fp32",
                      rank=args.powersgd_rank)
    if args.compression == "csc":
        # No momentum: under momentum correction the hook takes the optimizer's.
        given = dict(warmup_densities=warmup, warmup_unit=args.warmup_unit,
                     warmup_period=args.warmup_period, momentum_correction=args.momentum_correction,
                     chunk_size=args.chunk_size, clip_norm=args.clip_norm,
                     selection=args.selection, min_numel=args.min_numel)
        kwargs.update(density=args.density, **{k: v for k, v in given.items() if v is not None})
    try:
        return CompressionConfig(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"compression settings rejected: {exc}")


def resolve(args: argparse.Namespace, env=os.environ) -> Config:
    """Validate the arguments and derive the run's values; raise ConfigError with one sentence."""
    if args.arch not in ARCHS and args.arch not in tv_models.list_models(module=tv_models):
        raise ConfigError(
            f"unknown arch {args.arch!r}: choose a torchvision.models classification model, "
            f"e.g. alexnet, resnet18, resnet50, or one of {', '.join(ARCHS)}"
        )
    dataset = dataset_kind(args.data, args.dataset)
    if args.dummy:
        pass
    elif dataset == "fashion-mnist":
        missing = [f for f in FASHION_FILES
                   if not os.path.isfile(os.path.join(args.data, "FashionMNIST", "raw", f))]
        if missing:
            raise ConfigError(
                f"Fashion-MNIST files {', '.join(missing)} not found under "
                f"{os.path.join(args.data, 'FashionMNIST', 'raw')!r}: run "
                f"`python experiments/imagenet/prepare.py --dataset fashion-mnist --out "
                f"{args.data}`"
            )
    else:
        for split in ("train", "val"):
            if not os.path.isdir(os.path.join(args.data, split)):
                raise ConfigError(
                    f"data directory {os.path.join(args.data, split)!r} not found: pass the "
                    f"ImageFolder root holding train/ and val/, a folder holding "
                    f"FashionMNIST/raw/, or --dummy"
                )
    image_size = args.image_size or (28 if dataset == "fashion-mnist" else 224)
    if dataset == "fashion-mnist" and not args.dummy and image_size != 28:
        raise ConfigError(f"Fashion-MNIST's images are 28x28: leave out --image-size or pass 28, "
                          f"got {image_size}")
    if args.fsdp and (args.horovod or args.compression not in ("none", "fp16", "csc")
                      or not args.no_checkpoint):
        raise ConfigError(f"--fsdp runs with --compression none, fp16 or csc (not "
                          f"{args.compression}{' and --horovod' if args.horovod else ''}) and "
                          "--no-checkpoint (this script saves DDP checkpoints only)")
    if args.compression_group != "ddp" and (args.horovod or args.fsdp or args.compression not in
                                             ("fp16", "csc", "gf-powersgd")):
        raise ConfigError("--compression-group gradientflow puts gradientflow's compressed "
                          "traffic (--compression fp16, csc or gf-powersgd, with DDP) on a group "
                          f"of its own; got --compression {args.compression}"
                          f"{' --horovod' if args.horovod else ''}{' --fsdp' if args.fsdp else ''}")
    if args.horovod and args.compression not in ("none", "fp16"):
        raise ConfigError(f"--horovod takes --compression none or fp16 (Horovod's own "
                          f"compressors), got {args.compression}")
    if args.powersgd_rank < 1 or (args.powersgd_start_iter is not None
                                  and args.powersgd_start_iter < 2):
        raise ConfigError("--powersgd-rank must be >= 1 and --powersgd-start-iter >= 2 (torch's "
                          "PowerSGD needs two plain steps with error feedback or warm start)")
    if not 0.0 < args.density <= 1.0:
        raise ConfigError(
            f"--density must lie in (0, 1] (the fraction of chunks sent), got {args.density}"
        )
    if args.chunk_size is not None and args.chunk_size < 1:
        raise ConfigError(
            f"--chunk-size must be a positive number of elements, got {args.chunk_size}"
        )
    backend_options = None
    if args.fusion_threshold is not None:
        if args.dist_backend != "gradientflow":
            raise ConfigError(
                "--fusion-threshold is a gradientflow option; "
                f"--dist-backend is {args.dist_backend}"
            )
        from gradientflow.config import parse_size

        try:  # the backend's own parser: one meaning of "64MB" everywhere
            backend_options = {
                "fusion_threshold": parse_size(args.fusion_threshold, "--fusion-threshold")
            }
        except ValueError as exc:
            raise ConfigError(str(exc))
    resume = args.resume
    if resume == "auto":  # the same command line starts a run and resumes it after a restart
        resume = os.path.join(args.checkpoint_dir, "checkpoint.pth.tar")
        resume = resume if os.path.isfile(resume) else ""
    elif resume and not os.path.isfile(resume):
        raise ConfigError(f"--resume: no checkpoint at {args.resume!r}")
    if args.epochs < 1 or not 0 <= args.start_epoch <= args.epochs:
        raise ConfigError(
            "--epochs must be >= 1 and --start-epoch in [0, epochs], "
            f"got {args.epochs}, {args.start_epoch}"
        )
    for name in ("workers", "steps_per_epoch", "val_split"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0")
    if args.report_test:
        if not args.val_split:
            raise ConfigError("--report-test needs --val-split: without a validation split every "
                              "epoch is already scored on the test set")
        try:
            protocol.check_report_seed(args.seed)
        except protocol.ProtocolError as exc:
            raise ConfigError(str(exc))
    if (
        image_size < 8
        or args.num_classes < 2
        or args.print_freq < 1
        or args.lr <= 0
        or args.lr_base_batch < 1
    ):
        raise ConfigError(
            "--image-size >= 8, --num-classes >= 2, -p >= 1, --lr > 0 "
            "and --lr-base-batch >= 1 are required"
        )
    try:
        lr_steps = tuple(sorted(float(s) for s in args.lr_steps.split(",") if s.strip()))
    except ValueError:
        raise ConfigError(
            f"--lr-steps {args.lr_steps!r} must be a comma list of epochs, e.g. 30,60"
        )
    world_size = int(env.get("WORLD_SIZE", "1"))
    if args.batch_size < world_size or args.batch_size % world_size:
        raise ConfigError(
            f"-b {args.batch_size} (the global batch) must be a multiple of the world size "
            f"{world_size}"
        )
    warmup = None if args.warmup is None else dgc_warmup(args.warmup, args.density)
    comp = (None if args.compression in ("none", "noop", "torch-fp16", "powersgd") or args.horovod
            else build_compression_config(args, warmup))
    return Config(
        data=args.data,
        dataset=dataset,
        dummy=args.dummy,
        arch=args.arch,
        num_classes=args.num_classes,
        image_size=image_size,
        augment=args.augment,
        workers=args.workers,
        epochs=args.epochs,
        start_epoch=args.start_epoch,
        steps_per_epoch=args.steps_per_epoch,
        val_split=args.val_split,
        report_test=args.report_test,
        batch_size=args.batch_size,
        per_rank_batch=args.batch_size // world_size,
        peak_lr=args.lr * args.batch_size / args.lr_base_batch,
        lr_warmup_epochs=args.lr_warmup_epochs,
        lr_schedule=args.lr_schedule,
        lr_steps=lr_steps,
        momentum=args.momentum,
        weight_decay=args.weight_decay,
        lars=args.lars,
        lars_eta=args.lars_eta,
        label_smoothing=args.label_smoothing,
        amp=args.amp,
        seed=args.seed,
        world_size=world_size,
        rank=int(env.get("RANK", "0")),
        local_rank=int(env.get("LOCAL_RANK", "0")),
        dist_backend=args.dist_backend,
        compression=args.compression,
        compression_config=comp,
        powersgd_rank=args.powersgd_rank,
        powersgd_start_iter=args.powersgd_start_iter,
        horovod=args.horovod,
        fsdp=args.fsdp,
        backend_options=backend_options,
        compression_group=args.compression_group,
        bucket_cap_mb=args.bucket_cap_mb,
        resume=resume,
        evaluate=args.evaluate,
        print_freq=args.print_freq,
        log=args.log,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint=not args.no_checkpoint,
        fault_kill_at_step=args.fault_kill_at_step,
    )


# --------------------------------------------------------------------------------------------
# Process group, data, model, optimiser.
# --------------------------------------------------------------------------------------------
def init_distributed(cfg: Config) -> torch.device:
    """Create the process group (env://, set by torchrun; a free local port when run alone).

    Backend options travel as pg_options, which the backend resolves once with its defaults.
    """
    init_method = "env://"
    if "MASTER_ADDR" not in os.environ:  # plain `python train.py`: a one-rank group on this machine
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    if cfg.dist_backend == "gradientflow":
        import gradientflow  # noqa: F401  registers the backend (the entry point does too)
    if torch.cuda.is_available():
        device = torch.device("cuda", cfg.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    options = {"pg_options": cfg.backend_options} if cfg.backend_options else {}
    dist.init_process_group(backend=cfg.dist_backend, init_method=init_method,
                            world_size=cfg.world_size, rank=cfg.rank, **options)
    if cfg.horovod:  # the process group above carries only the data sampler's and metrics' sums
        import horovod.torch as hvd

        hvd.init()
        if (hvd.rank(), hvd.size()) != (cfg.rank, cfg.world_size):
            raise RuntimeError(f"Horovod's rank {hvd.rank()} of {hvd.size()} differs from "
                               f"torch.distributed's {cfg.rank} of {cfg.world_size}: set "
                               f"HOROVOD_RANK/HOROVOD_SIZE as RANK/WORLD_SIZE")
    return device


class InMemoryImages(torch.utils.data.Dataset):
    """A torchvision data set's images held as one normalised tensor, augmented per item on
    tensors (a random shift of up to `pad` pixels, zero-filled, and a random horizontal flip).

    Fashion-MNIST's images are 28x28: a PIL round trip per image (torchvision's transforms)
    would cost more than a small model's step, so the uint8 tensor torchvision's class loads
    is normalised once and cropped by slicing.
    """

    def __init__(self, images: torch.Tensor, targets: torch.Tensor, augment: str,
                 channels: int = 1, pad: int = 2):
        x = (images.float().div(255.0) - FASHION_MEAN) / FASHION_STD
        self.x = x.unsqueeze(1).expand(-1, channels, -1, -1).contiguous()
        self.targets = targets.long()
        self.pad, self.augment = pad, augment
        self.padded = (torch.nn.functional.pad(self.x, (pad,) * 4) if augment != "none"
                       else None)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        if self.padded is None:
            return self.x[i], int(self.targets[i])
        h, w = self.x.shape[-2:]
        dy, dx = torch.randint(0, 2 * self.pad + 1, (2,)).tolist()
        x = self.padded[i, :, dy:dy + h, dx:dx + w]
        if self.augment == "imagenet" and torch.rand(()) < 0.5:  # "light": no flip
            x = x.flip(-1)
        return x, int(self.targets[i])


def fashion_mnist(cfg: Config, channels: int):
    """Fashion-MNIST's 60,000 training and 10,000 test images through torchvision's class
    (its IDX reader; nothing is downloaded), as InMemoryImages: the training set, a maker of
    its unaugmented view (the validation split's), the test set."""
    import torchvision.datasets as datasets

    sets = [datasets.FashionMNIST(cfg.data, train=train, download=False) for train in (True, False)]
    return (InMemoryImages(sets[0].data, sets[0].targets, cfg.augment, channels),
            lambda: InMemoryImages(sets[0].data, sets[0].targets, "none", channels),
            InMemoryImages(sets[1].data, sets[1].targets, "none", channels))


def in_channels(cfg: Config) -> int:
    """Input channels of the model: Fashion-MNIST's one grey channel for the shaped models
    (models.py), three (the grey replicated) for torchvision's and alexnet_bn."""
    return 1 if cfg.dataset == "fashion-mnist" and cfg.arch in SHAPED else 3


def build_datasets(cfg: Config):
    """(training set, the set scored every epoch, the test set read once at the end or None).

    With --val-split the set scored every epoch is the validation split carved out of the
    training set (protocol.carve) and the test set is kept for --report-test; without it every
    epoch is scored on the test set.
    """
    train, view, test = source_datasets(cfg)
    if not cfg.val_split:
        return train, test, None
    train, val = protocol.carve(train, view(), cfg.val_split)
    return train, val, test


def source_datasets(cfg: Config):
    """ImageNet's standard transforms on an ImageFolder, Fashion-MNIST, or FakeData for --dummy:
    (training set, a maker of its view with the evaluation transforms, test set)."""
    import torchvision.datasets as datasets
    import torchvision.transforms as T

    if cfg.dataset == "fashion-mnist" and not cfg.dummy:
        return fashion_mnist(cfg, in_channels(cfg))

    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    if cfg.dummy:
        n_train = cfg.steps_per_epoch * cfg.batch_size if cfg.steps_per_epoch else 1281167
        n_val = cfg.steps_per_epoch * cfg.batch_size if cfg.steps_per_epoch else 50000
        shape = (in_channels(cfg), cfg.image_size, cfg.image_size)
        train = datasets.FakeData(n_train, shape, cfg.num_classes, T.ToTensor())
        return (train, lambda: train,
                datasets.FakeData(n_val, shape, cfg.num_classes, T.ToTensor(),
                                  random_offset=n_train))
    s = cfg.image_size
    train_tf = {
        "imagenet": [T.RandomResizedCrop(s), T.RandomHorizontalFlip()],
        "light": [
            T.RandomResizedCrop(s, scale=(0.7, 1.0), ratio=(0.9, 1.1))
        ],  # digits are not mirror-symmetric
        "none": [T.Resize(s), T.CenterCrop(s)],
    }[cfg.augment]
    val_tf = (
        [T.Resize(int(s * 256 / 224)), T.CenterCrop(s)]
        if cfg.augment == "imagenet"
        else [T.Resize(s), T.CenterCrop(s)]
    )
    def folder(split: str, tf: list):
        return datasets.ImageFolder(os.path.join(cfg.data, split),
                                    T.Compose(tf + [T.ToTensor(), normalize]))

    return folder("train", train_tf), lambda: folder("train", val_tf), folder("val", val_tf)


def make_loader(dataset, cfg: Config, sampler, device) -> torch.utils.data.DataLoader:
    # Workers start by forkserver (spawn where there is none): forking a process whose torch or
    # numba OpenMP runtime has already run kills the child.
    ctx = None
    if cfg.workers > 0:
        import multiprocessing as mp
        ctx = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    return torch.utils.data.DataLoader(
        dataset, batch_size=cfg.per_rank_batch, sampler=sampler, num_workers=cfg.workers,
        multiprocessing_context=ctx, persistent_workers=cfg.workers > 0,
        pin_memory=device.type == "cuda", drop_last=sampler is not None)


def build_model(cfg: Config) -> nn.Module:
    """The --arch model, randomly initialised: ours (ARCHS) or torchvision's."""
    if cfg.arch in SHAPED:
        return ARCHS[cfg.arch](num_classes=cfg.num_classes, in_channels=in_channels(cfg))
    if cfg.arch in ARCHS:
        return ARCHS[cfg.arch](num_classes=cfg.num_classes)
    return tv_models.get_model(cfg.arch, weights=None, num_classes=cfg.num_classes)


class LARS(torch.optim.SGD):
    """SGD scaling each weight matrix's update by eta*||w|| / (||g + wd*w||) (You et al. 2017).

    Tensors in groups with lars=False (biases, BatchNorm) take plain SGD, as in the LARS paper.
    """

    def __init__(self, param_groups, lr, momentum, weight_decay, eta):
        for g in param_groups:
            g.setdefault("lars", True)
            g["lars_wd"] = weight_decay if g["lars"] else 0.0
            g["weight_decay"] = 0.0 if g["lars"] else g.get("weight_decay", 0.0)
        super().__init__(param_groups, lr=lr, momentum=momentum)
        self.eta = eta

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if not group["lars"]:
                continue
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.grad.add_(p, alpha=group["lars_wd"])
                w_norm, g_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(p.grad)
                trust = torch.where(
                    (w_norm > 0) & (g_norm > 0), self.eta * w_norm / g_norm, torch.ones_like(w_norm)
                )
                p.grad.mul_(trust)
        return super().step(closure)


def build_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    if not cfg.lars:
        return torch.optim.SGD(
            model.parameters(), lr=cfg.peak_lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    matrices = [p for p in model.parameters() if p.ndim > 1]
    vectors = [p for p in model.parameters() if p.ndim <= 1]
    return LARS(
        [
            {"params": matrices, "lars": True},
            {"params": vectors, "lars": False, "weight_decay": 0.0},
        ],
        lr=cfg.peak_lr,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
        eta=cfg.lars_eta,
    )


def learning_rate(cfg: Config, epoch: float) -> float:
    """Linear warm-up from 0, then step decay (x0.1 at each --lr-steps epoch), cosine to 0, or
    constant."""
    if epoch < cfg.lr_warmup_epochs:
        return cfg.peak_lr * epoch / cfg.lr_warmup_epochs
    if cfg.lr_schedule == "constant":
        return cfg.peak_lr
    if cfg.lr_schedule == "cosine":
        progress = (epoch - cfg.lr_warmup_epochs) / max(cfg.epochs - cfg.lr_warmup_epochs, 1e-9)
        return 0.5 * cfg.peak_lr * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.peak_lr * 0.1 ** sum(epoch >= s for s in cfg.lr_steps)


# --------------------------------------------------------------------------------------------
# Gradient communication: gradientflow's hook, or a plain timed allreduce for --compression none.
# --------------------------------------------------------------------------------------------
class TimedDDP(nn.parallel.DistributedDataParallel):
    """DDP timing whatever comm hook is registered: comm_s sums each bucket's hook-to-result time.

    With overlap the buckets' times can exceed the wall time they cover; without it (a hook that
    completes synchronously) the sum is the time backward spent communicating and compressing.
    """

    comm_s = 0.0

    def register_comm_hook(self, state, hook):
        def timed_hook(state, bucket):  # DDP checks for a parameter named `bucket`
            start = time.perf_counter()

            def done(fut):
                self.comm_s += time.perf_counter() - start
                return fut.value()

            return hook(state, bucket).then(done)

        super().register_comm_hook(state, timed_hook)


class DenseAllreduce:
    """The --compression none path: DDP's allreduce-mean, bytes counted like gradientflow's."""

    def __init__(self, ddp_model: TimedDDP):
        self.ddp, self.world_size, self.wire_bytes = ddp_model, dist.get_world_size(), 0
        ddp_model.register_comm_hook(self, type(self).hook)

    @staticmethod
    def hook(state: "DenseAllreduce", bucket):
        buf = bucket.buffer()
        state.wire_bytes += buf.numel() * buf.element_size()
        fut = dist.all_reduce(buf.div_(state.world_size), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    def set_epoch(self, epoch: int) -> None:
        pass

    def stats(self) -> dict:
        return {
            "wire_bytes": self.wire_bytes,
            "dense_bytes": self.wire_bytes,
            "comm_s": self.ddp.comm_s,
            "density": 1.0,
        }

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class NoCommunication(DenseAllreduce):
    """The --compression noop path: DDP with a hook that sends nothing, each rank's gradient
    left as it is. The time of a step with DDP's own costs and no communication: the bound on
    what any compression can reach (the ranks do not average, so it does not train alike)."""

    hook = staticmethod(noop_hook)  # torch's: the bucket's gradient as it is


class TorchHook(DenseAllreduce):
    """torch's own DDP compression hooks, as their users register them, bytes counted.

    torch-fp16: `fp16_compress_hook` (the bucket cast to FP16, allreduced, cast back).
    powersgd: `powerSGD_hook` with `PowerSGDState(matrix_approximation_rank=r,
    start_powerSGD_iter=start)`, error feedback and warm start on (torch's defaults, which its
    documentation recommends keeping); plain allreduce for the first `start` steps.
    """

    def __init__(self, ddp_model: TimedDDP, method: str, rank: int = 2, start_iter: int = 2):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        self.ddp, self.world_size, self.wire_bytes, self.dense_bytes = ddp_model, 1, 0, 0
        if method == "torch-fp16":
            self.powersgd, inner = None, default_hooks.fp16_compress_hook
        else:
            self.powersgd = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=rank,
                start_powerSGD_iter=start_iter, use_error_feedback=True, warm_start=True)
            inner = powerSGD_hook.powerSGD_hook

        def counted(state, bucket):
            buf = bucket.buffer()
            dense = buf.numel() * buf.element_size()
            self.dense_bytes += dense
            if self.powersgd is None:
                self.wire_bytes += dense // 2
                return inner(None, bucket)
            plain = self.powersgd.iter < self.powersgd.start_powerSGD_iter
            before = self.powersgd.total_numel_after_compression
            fut = inner(self.powersgd, bucket)
            # PowerSGD counts the elements it sends (P, Q and the tensors it leaves dense).
            self.wire_bytes += dense if plain else 4 * (
                self.powersgd.total_numel_after_compression - before)
            return fut

        ddp_model.register_comm_hook(None, counted)

    def stats(self) -> dict:
        return {"wire_bytes": self.wire_bytes, "dense_bytes": self.dense_bytes,
                "comm_s": self.ddp.comm_s,
                "density": self.wire_bytes / max(self.dense_bytes, 1)}


class Unwrapped(nn.Module):
    """The model as Horovod trains it (no DDP), with DDP's `.module` for the checkpoint code."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


class HorovodAverage:
    """--horovod: gradients averaged by Horovod's DistributedOptimizer, as its users train
    (its hooks allreduce every gradient during backward, step() waits for them), with
    Compression.none or Compression.fp16. Wire bytes: every gradient once per step, in the
    compressor's dtype."""

    def __init__(self, model: nn.Module, optimizer, fp16: bool):
        import horovod.torch as hvd

        compression = hvd.Compression.fp16 if fp16 else hvd.Compression.none
        self.optimizer = hvd.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), compression=compression)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(self.optimizer, root_rank=0)
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.dense_step, self.wire_step = 4 * numel, (2 if fp16 else 4) * numel
        self.steps = 0
        # A training forward is a step (the optimizer's post-step hook fires twice here: on
        # Horovod's subclass and on the optimizer class under it).
        model.register_forward_pre_hook(lambda module, _: self._count(module.training))

    def _count(self, training: bool) -> None:
        self.steps += training

    def set_epoch(self, epoch: int) -> None:
        pass

    def stats(self) -> dict:
        return {"wire_bytes": self.steps * self.wire_step,
                "dense_bytes": self.steps * self.dense_step, "comm_s": 0.0,
                "density": self.wire_step / self.dense_step}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def shard_model(model: nn.Module) -> None:
    """FSDP2 as its users apply it: each top-level block with parameters its own group, then
    the root (the groups' gradients reduce-scatter as backward reaches them)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = next(model.parameters()).device.type
    mesh = init_device_mesh(device, (dist.get_world_size(),))  # one mesh: compression needs it
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)


class FSDPCompression:
    """--fsdp: FSDP2's own reduce-scatter (--compression none) or gradientflow.hooks.register
    on the sharded model, seen through the same calls as DenseAllreduce. Bytes are counted per
    rank: a dense step sends the model's FP32 gradient into the reduce-scatter; comm_s is not
    timed (FSDP's collectives run inside its own hooks)."""

    def __init__(self, model: nn.Module, config, optimizer):
        import gradientflow.hooks
        from gradientflow.kernels import warm

        self.steps, self.config = 0, config
        self.dense_per_step = 4 * sum(p.numel() for p in model.parameters())  # DTensors: global
        self.state = (None if config is None
                      else gradientflow.hooks.register(model, config, optimizer=optimizer))
        if self.state is not None:  # seed-for-seed runs use one kernel from the first step
            warm.wait()
        optimizer.register_step_post_hook(lambda *_: self._count())

    def _count(self) -> None:
        self.steps += 1

    def set_epoch(self, epoch: int) -> None:
        if self.state is not None:
            self.state.set_epoch(epoch)

    def stats(self) -> dict:
        dense = self.steps * self.dense_per_step
        wire = (dense if self.state is None else
                sum(v["wire_bytes"] for v in self.state.stats().values()))
        return {"wire_bytes": wire, "dense_bytes": dense, "comm_s": 0.0,
                "density": getattr(self.config, "density", 1.0)}

    def state_dict(self) -> dict:
        return {} if self.state is None else self.state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self.state is not None:
            self.state.load_state_dict(state)


def nic_tx_bytes() -> int | None:
    """Bytes this process's network namespace has sent on gloo's NIC (GLOO_SOCKET_IFNAME), from
    /proc/net/dev; None on loopback or without the variable. On an emulated switch each rank
    has its own namespace, so this is what the rank put on the wire, whatever sent it."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if not ifname or ifname == "lo":
        return None
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, sep, rest = line.partition(":")
                if sep and name.strip() == ifname:
                    return int(rest.split()[8])  # receive has 8 fields, then transmit bytes
    except OSError:
        return None
    return None


class GradientFlowHook:
    """gradientflow.hooks.register's state, seen through the same four calls as DenseAllreduce."""

    def __init__(self, ddp_model: TimedDDP, config, grad_scaler, optimizer,
                 own_group: bool = False):
        import gradientflow.autotune
        import gradientflow.hooks

        self.ddp = ddp_model
        # own_group: the compressed traffic on a gradientflow group of its own; DDP keeps its
        # group (gloo) for the rest, so its buffer broadcast is gloo's, not a checked round.
        group = dist.new_group(backend="gradientflow") if own_group else None
        self.state = gradientflow.hooks.register(
            ddp_model, config, group, optimizer=optimizer,  # its rates (and momentum, under MC)
            grad_scaler=grad_scaler if grad_scaler.is_enabled() else None)
        # Runs are compared seed for seed: every compressed step uses the numba kernels (until
        # they are loaded the dispatch would run the torch reference, whose norms may differ in
        # the last bits). Loaded from the cache `make install` filled, before training starts.
        from gradientflow.kernels import warm

        warm.wait()
        # GRADIENTFLOW_AUTOTUNE=1 tunes the engine from the group on; the chunk size too, here.
        tuner = gradientflow.autotune.tuner_of(ddp_model.process_group)
        if tuner is not None:
            tuner.tune_compression(self.state)

    def set_epoch(self, epoch: int) -> None:
        self.state.set_epoch(epoch)  # drives the dense warm-up

    def stats(self) -> dict:
        s = self.state.stats()
        # Run totals; the older names are kept for gradientflow versions that used them.
        return {"wire_bytes": s.get("wire_bytes", s.get("total_wire_bytes")),
                "dense_bytes": s.get("dense_bytes", s.get("total_dense_fp32_bytes")),
                "comm_s": self.ddp.comm_s, "density": s["density_in_force"]}

    def state_dict(self) -> dict:
        return self.state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.state.load_state_dict(state)


# --------------------------------------------------------------------------------------------
# Train, evaluate, checkpoint.
# --------------------------------------------------------------------------------------------
def accuracy(output: torch.Tensor, target: torch.Tensor, topk=(1, 5)) -> list:
    """Number of samples whose target is among the top-k predictions, for each k."""
    maxk = min(max(topk), output.shape[1])
    pred = output.topk(maxk, 1, True, True).indices
    correct = pred.eq(target[:, None])
    return [correct[:, :min(k, maxk)].any(dim=1).sum().item() for k in topk]


def autocast(cfg: Config, device: torch.device):
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    return torch.autocast(device.type, dtype=dtype, enabled=cfg.amp)


def train_one_epoch(cfg, epoch, model, criterion, optimizer, scaler, loader, comm, device):
    from tqdm import tqdm

    model.train()
    steps = len(loader) if not cfg.steps_per_epoch else min(cfg.steps_per_epoch, len(loader))
    bar = tqdm(total=steps, desc=f"epoch {epoch}", disable=None if cfg.rank == 0 else True,
               dynamic_ncols=True, leave=False)
    sums = torch.zeros(4, dtype=torch.float64)  # loss*n, correct@1, correct@5, n
    comm_before, nic_before = comm.stats(), nic_tx_bytes()
    start = time.perf_counter()
    # Wall seconds of each part of a step, summed: where a setting's step time goes (forward
    # holds DDP's buffer broadcast, backward the comm hooks and DDP's wait for their results).
    phases = dict.fromkeys(("data", "forward", "backward", "step"), 0.0)
    t_mark = start
    for i, (images, target) in enumerate(loader):
        if i >= steps:
            break
        gradientflow.mark_step(epoch * steps + i)  # timeline markers and sampling
        if epoch * steps + i == cfg.fault_kill_at_step:
            maybe_kill_self(cfg)
        for g in optimizer.param_groups:
            g["lr"] = learning_rate(cfg, epoch + i / steps)
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        t0 = time.perf_counter()
        with autocast(cfg, device):
            output = model(images)
            loss = criterion(output, target)
        t1 = time.perf_counter()
        optimizer.zero_grad()  # set_to_none, torch's default; Horovod's takes no argument
        scaler.scale(loss).backward()  # DDP's comm hook runs here, overlapped with backward
        t2 = time.perf_counter()
        scaler.step(optimizer)
        scaler.update()
        t3 = time.perf_counter()
        phases["data"] += t0 - t_mark
        phases["forward"] += t1 - t0
        phases["backward"] += t2 - t1
        phases["step"] += t3 - t2
        top1, top5 = accuracy(output.detach().float(), target)
        sums += torch.tensor(
            [loss.item() * len(target), top1, top5, len(target)], dtype=torch.float64
        )
        bar.update(1)
        if i % cfg.print_freq == 0:
            bar.set_postfix(loss=f"{sums[0] / sums[3]:.3f}", top1=f"{100 * sums[1] / sums[3]:.1f}",
                            lr=f"{optimizer.param_groups[0]['lr']:.3g}")
        t_mark = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    bar.close()
    comm_after, nic_after = comm.stats(), nic_tx_bytes()
    dist.all_reduce(sums)  # exact: a plain all_reduce is never compressed
    return {
        "steps": steps,
        "train_time_s": elapsed,
        "images_per_s": sums[3].item() / elapsed,
        "train_loss": sums[0].item() / sums[3].item(),
        "train_top1": 100 * sums[1].item() / sums[3].item(),
        "comm_s": comm_after["comm_s"] - comm_before["comm_s"],
        "phase_s": phases,
        "wire_bytes": comm_after["wire_bytes"] - comm_before["wire_bytes"],
        "dense_bytes": comm_after["dense_bytes"] - comm_before["dense_bytes"],
        "density": comm_after["density"],
        "nic_tx_bytes": None if nic_before is None else nic_after - nic_before,
    }


@torch.no_grad()
def evaluate(cfg, model, criterion, val_set, device) -> dict:
    """Each rank scores every world_size-th image (no padding), then the sums are allreduced."""
    model.eval()
    shard = torch.utils.data.Subset(val_set, range(cfg.rank, len(val_set), cfg.world_size))
    loader = make_loader(shard, dataclasses.replace(cfg, workers=min(cfg.workers, 1)), None, device)
    sums = torch.zeros(4, dtype=torch.float64)
    for i, (images, target) in enumerate(loader):
        if cfg.steps_per_epoch and i >= cfg.steps_per_epoch:
            break
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with autocast(cfg, device):
            output = model(images)
        loss = criterion(output.float(), target)
        top1, top5 = accuracy(output.float(), target)
        sums += torch.tensor(
            [loss.item() * len(target), top1, top5, len(target)], dtype=torch.float64
        )
    dist.all_reduce(sums)
    n = max(sums[3].item(), 1.0)
    return {
        "val_loss": sums[0].item() / n,
        "val_top1": 100 * sums[1].item() / n,
        "val_top5": 100 * sums[2].item() / n,
    }


def rank_cpu_seconds(cfg: Config) -> list:
    """Each rank's CPU time so far (user + system, every thread of its process), in rank order:
    what a run cost the machine, beside its wall time."""
    times = torch.zeros(cfg.world_size, dtype=torch.float64)
    times[cfg.rank] = time.process_time()
    dist.all_reduce(times)  # exact: a plain all_reduce is never compressed
    return [round(t, 2) for t in times.tolist()]


def maybe_kill_self(cfg: Config) -> None:
    """--fault-kill-at-step: the last rank dies as a crash would (SIGKILL: no cleanup, no
    exception), in torchrun's first attempt only, so that the restarted job can finish."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if cfg.rank == cfg.world_size - 1 and attempt == 0:
        print(f"[rank {cfg.rank}] fault injection: SIGKILL at step {cfg.fault_kill_at_step} "
              f"(attempt {attempt}, time {time.time():.3f})", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def residual_checksum(comm_state: dict) -> str:
    """CRC-32 and L1 norm of the compressor's residual memory, for the logs: a resumed run
    prints the same line for what it loaded as the saving run printed for what it saved."""
    crc, l1 = 0, 0.0
    memory = comm_state.get("memory", {})
    for slot in sorted(memory):
        for name in sorted(memory[slot]):
            t = memory[slot][name].detach().float().contiguous().cpu()
            crc = zlib.crc32(f"{slot}/{name}".encode(), crc)
            crc = zlib.crc32(t.numpy().tobytes(), crc)
            l1 += t.abs().sum().item()
    return f"crc32 {crc:08x} l1 {l1:.6g}"


def shard_path(checkpoint: str, rank: int) -> str:
    """Per-rank file beside the checkpoint: compressor residuals and RNG state differ per rank."""
    return f"{checkpoint}.rank{rank}"


def save_checkpoint(cfg, epoch, model, optimizer, scaler, comm, best_acc1) -> None:
    os.makedirs(cfg.checkpoint_dir, exist_ok=True)
    path = os.path.join(cfg.checkpoint_dir, "checkpoint.pth.tar")
    shard = {"rank": cfg.rank, "world_size": cfg.world_size, "compressor": comm.state_dict(),
             "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                     "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}}
    torch.save(shard, shard_path(path, cfg.rank) + ".tmp")
    os.replace(shard_path(path, cfg.rank) + ".tmp", shard_path(path, cfg.rank))
    print(f"[rank {cfg.rank}] checkpoint saved after epoch {epoch}: compressor residuals "
          f"{residual_checksum(shard['compressor'])}", flush=True)
    if cfg.rank == 0:
        torch.save(
            {
                "epoch": epoch + 1,
                "arch": cfg.arch,
                "state_dict": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(),
                "best_acc1": best_acc1,
                "world_size": cfg.world_size,
                "config": {k: repr(v) for k, v in dataclasses.asdict(cfg).items()},
            },
            path + ".tmp",
        )
        os.replace(path + ".tmp", path)
    dist.barrier()  # every shard is on disk before anyone goes on (or exits)


def load_checkpoint(cfg, model, optimizer, scaler, comm, device) -> tuple:
    ckpt = torch.load(cfg.resume, map_location=device, weights_only=False)
    model.module.load_state_dict(ckpt["state_dict"])
    if cfg.evaluate:  # weights are all -e needs; the optimiser may have been another (e.g. LARS)
        return ckpt["epoch"], ckpt.get("best_acc1", 0.0)
    optimizer.load_state_dict(ckpt["optimizer"])
    scaler.load_state_dict(ckpt["scaler"])
    shard_file = shard_path(cfg.resume, cfg.rank)
    if ckpt.get("world_size") == cfg.world_size and os.path.isfile(shard_file):
        shard = torch.load(shard_file, map_location="cpu", weights_only=False)
        comm.load_state_dict(shard["compressor"])
        # Read back from the compressor itself: proves the residuals are in use, not just read.
        print(f"[rank {cfg.rank}] resumed from {cfg.resume} at epoch {ckpt['epoch']}: compressor "
              f"residuals {residual_checksum(comm.state_dict())}", flush=True)
        torch.set_rng_state(shard["rng"]["torch"])
        random.setstate(shard["rng"]["python"])
        if shard["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(shard["rng"]["cuda"])
    else:
        print(
            f"[rank {cfg.rank}] warning: {shard_file} missing or saved by "
            f"{ckpt.get('world_size')} ranks "
            f"(now {cfg.world_size}): compressor residuals start at zero",
            file=sys.stderr,
        )
    return ckpt["epoch"], ckpt.get("best_acc1", 0.0)


def print_config(cfg: Config, device: torch.device) -> None:
    derived = {
        "world_size": cfg.world_size,
        "device": str(device),
        "per_rank_batch": cfg.per_rank_batch,
        "peak_lr": round(cfg.peak_lr, 6),
        "compression": cfg.compression_config or "none",
        "threads_per_rank": torch.get_num_threads(),
    }
    shown = dataclasses.asdict(cfg)
    del shown["compression_config"]
    # paths inside the working directory relative to it: a log reads the same in any checkout
    if cfg.data and os.path.isabs(cfg.data) and cfg.data.startswith(os.getcwd() + os.sep):
        shown["data"] = os.path.relpath(cfg.data)
    print("config: " + " ".join(f"{k}={v}" for k, v in shown.items()), flush=True)
    print("derived: " + " ".join(f"{k}={v}" for k, v in derived.items()), flush=True)


# --------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    try:
        cfg = resolve(parse_args(argv))
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2

    device = init_distributed(cfg)
    try:
        if cfg.seed is not None:
            random.seed(cfg.seed)
            torch.manual_seed(cfg.seed)
            torch.backends.cudnn.deterministic = True
        train_set, val_set, test_set = build_datasets(cfg)
        model = build_model(cfg).to(device)
        if cfg.fsdp:  # before the optimizer: fully_shard replaces the parameters
            shard_model(model)
        criterion = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing).to(device)
        optimizer = build_optimizer(model, cfg)
        scaler = torch.amp.GradScaler(device.type, enabled=cfg.amp and device.type == "cuda")
        if cfg.horovod:
            comm = HorovodAverage(model, optimizer, fp16=cfg.compression == "fp16")
            ddp = Unwrapped(model)
            optimizer = comm.optimizer
        elif cfg.fsdp:
            ddp, comm = model, FSDPCompression(model, cfg.compression_config, optimizer)
        else:
            ddp, comm = build_ddp(cfg, model, device, optimizer, scaler, len(train_set))
        start_epoch, best_acc1 = cfg.start_epoch, 0.0
        if cfg.resume:
            start_epoch, best_acc1 = load_checkpoint(cfg, ddp, optimizer, scaler, comm, device)
        if cfg.rank == 0:
            print_config(cfg, device)
            print(
                f"model: {cfg.arch}, "
                f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters; "
                f"train {len(train_set)} / "
                + (f"validation split {len(val_set)}" if cfg.val_split else f"val {len(val_set)}")
                + (f" / test {len(test_set)}, read once after the last epoch"
                   if cfg.report_test else "") + " images",
                flush=True,
            )
        if cfg.evaluate:
            result = evaluate(cfg, ddp, criterion, val_set, device)
            if cfg.rank == 0:
                print(json.dumps(result), flush=True)
            return 0

        sampler = torch.utils.data.distributed.DistributedSampler(
            train_set,
            num_replicas=cfg.world_size,
            rank=cfg.rank,
            shuffle=True,
            seed=cfg.seed or 0,
            drop_last=True,
        )
        train_loader = make_loader(train_set, cfg, sampler, device)
        for epoch in range(start_epoch, cfg.epochs):
            sampler.set_epoch(epoch)
            comm.set_epoch(epoch)
            record = {"epoch": epoch, "lr": learning_rate(cfg, epoch)}
            gradientflow.reset_stats()
            record.update(
                train_one_epoch(
                    cfg, epoch, ddp, criterion, optimizer, scaler, train_loader, comm, device
                )
            )
            # The backend's own counters for the epoch: operations, fused messages, agreement
            # rounds, time in communication, overlap (see gradientflow.observability.stats).
            record["engine"] = gradientflow.stats()
            record.update(evaluate(cfg, ddp, criterion, val_set, device))
            record["eval_set"] = "validation" if cfg.val_split else "test"
            if cfg.report_test and epoch == cfg.epochs - 1:  # the test set, once, at the end
                record.update({k.replace("val_", "test_"): v for k, v in
                               evaluate(cfg, ddp, criterion, test_set, device).items()})
            record["rank_cpu_s"] = rank_cpu_seconds(cfg)
            # Where the logging rank's CPU went, by kind of thread: ours, gloo's, the caller's.
            record["thread_cpu_s"] = provenance.thread_cpu_seconds()
            record["wire_bytes_per_step"] = record["wire_bytes"] / record["steps"]
            record["dense_bytes_per_step"] = record["dense_bytes"] / record["steps"]
            best_acc1 = max(best_acc1, record["val_top1"])
            if cfg.rank == 0:
                print(
                    f"epoch {epoch}: loss {record['train_loss']:.4f} "
                    f"val top-1 {record['val_top1']:.2f} "
                    f"top-5 {record['val_top5']:.2f} | {record['images_per_s']:.0f} img/s | "
                    f"wire {record['wire_bytes_per_step'] / 1e6:.3f} MB/step of "
                    f"{record['dense_bytes_per_step'] / 1e6:.3f} dense "
                    f"| comm {record['comm_s']:.2f} s",
                    flush=True,
                )
                if cfg.log:
                    Path(cfg.log).parent.mkdir(parents=True, exist_ok=True)
                    with open(cfg.log, "a") as f:
                        f.write(json.dumps(record) + "\n")
            if cfg.checkpoint:
                save_checkpoint(cfg, epoch, ddp, optimizer, scaler, comm, best_acc1)
        return 0
    finally:
        dist.destroy_process_group()


def build_ddp(cfg: Config, model: nn.Module, device, optimizer, scaler, n_train: int):
    """DDP around `model` and the gradient communication --compression asks for."""
    # DDP re-buckets parameters by gradient order after its first step; a resumed run would
    # do that one step late and cut other CSC chunks for that step. find_unused_parameters
    # switches the re-bucketing off, so every step of every run uses the same buckets.
    ddp = TimedDDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=cfg.bucket_cap_mb,
        find_unused_parameters=cfg.compression == "csc",
        # Gradients live in DDP's buckets: no copy into them and back out each step, for
        # every setting alike (README.md: this matters most under compression).
        gradient_as_bucket_view=True,
    )
    steps = (n_train // cfg.world_size) // cfg.per_rank_batch
    steps = min(steps, cfg.steps_per_epoch) if cfg.steps_per_epoch else steps
    start = cfg.powersgd_start_iter or max(2, round(0.1 * steps * cfg.epochs))
    if cfg.compression in ("torch-fp16", "powersgd"):
        return ddp, TorchHook(ddp, cfg.compression, cfg.powersgd_rank, start)
    config = cfg.compression_config
    if cfg.compression == "gf-powersgd":  # dense for the same first steps as torch's hook
        config = dataclasses.replace(config, start_step=start)
    return ddp, (DenseAllreduce(ddp) if cfg.compression == "none"
                 else NoCommunication(ddp) if cfg.compression == "noop"
                 else GradientFlowHook(ddp, config, scaler, optimizer,
                                       cfg.compression_group == "gradientflow"))


if __name__ == "__main__":
    sys.exit(main())
