"""Train the byte-level GPT (model.py) on the Jargon File (corpus.py) with AdamW, data-parallel
over torch.distributed, under one gradient communication setting.

    torchrun --standalone --nproc-per-node 2 experiments/lm/train_lm.py --setting csc \
        --steps 2000 --seed 10 --json-log run.jsonl

Settings (all on the gradientflow backend, DDP with gradient_as_bucket_view):
  ddp         DDP's own dense FP32 allreduce
  csc         GradientFlow's CSC at --density (gradientflow.hooks.register, the default recipe:
              the optimizer keeps its state; the residual is plain error feedback, as AdamW
              does not step as SGD; allow_adaptive_optimizer=True, since the library refuses
              AdamW by default), with any --csc-option on top
  torch-fp16  torch's fp16_compress_hook

The learning rate warms up linearly over --warmup-steps, then follows a cosine to
--min-lr-ratio of its peak at --steps. Each rank draws its own random windows of
--context + 1 bytes from the training split (seeded by the seed and the rank). Every
--eval-every steps, and at the end, the validation split is scored on its consecutive
windows; the test split is read once, after the last step. One JSON line per evaluation.
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import corpus  # noqa: E402
from model import GPT  # noqa: E402

SETTINGS = ("ddp", "csc", "torch-fp16")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setting", choices=SETTINGS, default="ddp")
    p.add_argument("--density", type=float, default=0.01, help="csc: fraction of chunks sent")
    p.add_argument("--csc-option", action="append", default=[], metavar="NAME=VALUE",
                   help="csc: one more CompressionConfig option (a Python literal), e.g. "
                   "min_numel=65537 or warmup_period=20; repeatable")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=32, help="global batch, sequences")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (0: none)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=0,
                   help="cap on validation windows per evaluation (0: the whole split)")
    p.add_argument("--seed", type=int, default=10)
    p.add_argument("--corpus", type=Path, default=corpus.SOURCE)
    p.add_argument("--json-log", type=Path, default=None)
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.eval_every < 1 or args.warmup_steps < 0:
        p.error("--steps, --batch and --eval-every must be >= 1, --warmup-steps >= 0")
    if not 0 < args.density <= 1:
        p.error(f"--density must lie in (0, 1], got {args.density}")
    try:
        args.csc_options = dict(_option(text) for text in args.csc_option)
    except ValueError as exc:
        p.error(str(exc))
    return args


def _option(text: str) -> tuple:
    """("name", value) of a NAME=VALUE --csc-option, the value read as a Python literal."""
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise ValueError(f"--csc-option {text!r}: expected NAME=VALUE")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise ValueError(f"--csc-option {text!r}: {value!r} is not a Python literal") from None


def learning_rate(args, step: int) -> float:
    """Linear warm-up to --lr over --warmup-steps, then a cosine to --min-lr-ratio * --lr."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    floor = args.min_lr_ratio
    return args.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def batch(data: torch.Tensor, n: int, context: int, gen: torch.Generator) -> tuple:
    """n random windows of context + 1 bytes: inputs and next-byte targets."""
    starts = torch.randint(0, len(data) - context - 1, (n,), generator=gen)
    rows = torch.stack([data[s:s + context + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


@torch.no_grad()
def score(model, data: torch.Tensor, context: int, rank: int, world: int, cap: int = 0,
          per_batch: int = 32) -> float:
    """Mean next-byte cross-entropy over the split's consecutive windows (each rank scores every
    world-th window; the sums are allreduced)."""
    model.eval()
    starts = list(range(0, len(data) - context - 1, context))
    if cap:
        starts = starts[:cap]
    mine = starts[rank::world]
    sums = torch.zeros(2, dtype=torch.float64)
    for i in range(0, len(mine), per_batch):
        rows = torch.stack([data[s:s + context + 1] for s in mine[i:i + per_batch]]).long()
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1),
                               reduction="sum")
        sums += torch.tensor([loss.item(), rows[:, 1:].numel()], dtype=torch.float64)
    dist.all_reduce(sums)
    model.train()
    return (sums[0] / sums[1]).item()


def communication(ddp, setting: str, density: float, optimizer, options: dict | None = None):
    """Register the setting's DDP communication hook (csc: with `options`, more
    CompressionConfig options); returns the hook's state or None."""
    if setting == "csc":
        import gradientflow
        from gradientflow.compression import CompressionConfig

        # The library refuses CSC beside AdamW unless told otherwise; this stage measures
        # exactly that combination, so it opts in.
        config = CompressionConfig(method="csc", density=density, allow_adaptive_optimizer=True,
                                   **(options or {}))
        return gradientflow.hooks.register(ddp, config, optimizer=optimizer)
    if setting == "torch-fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    return None


def init() -> tuple[int, int]:
    """The process group on the gradientflow backend (env:// under torchrun, else one rank)."""
    import gradientflow  # noqa: F401  registers the backend

    if "MASTER_ADDR" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gradientflow", init_method=f"tcp://127.0.0.1:{port}",
                                world_size=1, rank=0)
    else:
        dist.init_process_group("gradientflow")
    return dist.get_rank(), dist.get_world_size()


def cpu_seconds(rank: int, world: int) -> list:
    """Each rank's CPU time so far, in rank order."""
    times = torch.zeros(world, dtype=torch.float64)
    times[rank] = time.process_time()
    dist.all_reduce(times)
    return [round(t, 2) for t in times.tolist()]


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        splits = corpus.load(args.corpus)
    except corpus.CorpusUnavailable as exc:
        print(f"train_lm.py: error: {exc}", file=sys.stderr)
        return 2
    rank, world = init()
    try:
        if args.batch % world:
            raise SystemExit(f"train_lm.py: error: --batch {args.batch} must be a multiple of "
                             f"the world size {world}")
        torch.manual_seed(args.seed)  # the same initial weights on every rank and setting
        model = GPT(corpus.VOCAB, args.context, args.layers, args.width, args.heads)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        other = [p for p in model.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                       {"params": other, "weight_decay": 0.0}],
                                      lr=args.lr, betas=(0.9, 0.95))
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        communication(ddp, args.setting, args.density, optimizer, args.csc_options)
        gen = torch.Generator().manual_seed(1000 * args.seed + rank)
        if rank == 0:
            params = sum(p.numel() for p in model.parameters())
            print(f"GPT {args.layers} layers, width {args.width}, context {args.context}: "
                  f"{params / 1e6:.2f} M parameters; {args.setting}, {world} ranks; corpus "
                  + ", ".join(f"{k} {len(v):,} bytes" for k, v in splits.items()), flush=True)
        start, losses = time.perf_counter(), []
        for step in range(args.steps):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(args, step)
            x, y = batch(splits["train"], args.batch // world, args.context, gen)
            logits = ddp(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            if args.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            losses.append(loss.item())
            last = step == args.steps - 1
            if (step + 1) % args.eval_every and not last:
                continue
            train_loss = torch.tensor([sum(losses) / len(losses)], dtype=torch.float64)
            dist.all_reduce(train_loss)
            losses = []
            val = score(model, splits["val"], args.context, rank, world, args.eval_windows)
            record = {"step": step + 1, "lr": learning_rate(args, step),
                      "train_loss": train_loss.item() / world, "val_loss": val,
                      "val_ppl": math.exp(val), "elapsed_s": time.perf_counter() - start,
                      "eval_set": "validation"}
            if last:  # the test split, once
                test = score(model, splits["test"], args.context, rank, world)
                record.update(test_loss=test, test_ppl=math.exp(test),
                              rank_cpu_s=cpu_seconds(rank, world))
                import gradientflow

                stats = gradientflow.stats()
                record.update(wire_bytes=stats.get("wire_bytes"),
                              dense_bytes=stats.get("dense_bytes"))
            if rank == 0:
                print(json.dumps(record), flush=True)
                if args.json_log:
                    args.json_log.parent.mkdir(parents=True, exist_ok=True)
                    with open(args.json_log, "a") as f:
                        f.write(json.dumps(record) + "\n")
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
