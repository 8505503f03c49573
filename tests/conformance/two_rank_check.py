"""The 2-rank check of one torch install: init, every collective, DDP with the CSC hook.

    python tests/conformance/two_rank_check.py [--examples 120] [--steps 20]

On 2 CPU ranks of the installed torch, with init_process_group("gradientflow"):
every collective of torch.distributed against a local reference (tests/test_collectives.py's
property, `--examples` random calls), the ops torch's parallelism stack issues against gloo
(tests/conformance/test_torch_clients.py), and DDP with CSC at density 0.01 (momentum
correction) for `--steps` steps. Prints one line per part and the parameters' digest on each
rank; exits non-zero unless every part passed and the parameters are identical on every rank.
"""
from __future__ import annotations

import argparse
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

from harness import RankPool  # noqa: E402


def ddp_csc(rank, world, steps):
    """Rank body: DDP with the CSC hook; the loss of each step and a digest of the parameters."""
    import hashlib

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradientflow
    from gradientflow.compression import CompressionConfig

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gradientflow.hooks.register(model, CompressionConfig(method="csc", density=0.01),
                                optimizer=opt)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step * 100 + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return losses, hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=120)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    import torch

    from gradientflow.backend.backend import BACKEND_BASE
    from test_collectives import collectives_property
    from test_torch_clients import _assert_same, stack_ops

    print(f"torch {torch.__version__}; backend base class {BACKEND_BASE.__module__}."
          f"{BACKEND_BASE.__name__}")
    pool = RankPool(2)
    try:
        kinds = pool.run(collectives_property, args.examples, timeout=600)
        print(f"collectives: {args.examples} random calls match the reference on both ranks "
              f"({len(kinds[0])} kinds: {', '.join(kinds[0])})")
        runs = {b: pool.run(stack_ops, backend=b, timeout=300) for b in ("gloo", "gradientflow")}
        _assert_same(runs)
        print(f"parallelism-stack ops: {len(runs['gloo'][0])} groups equal gloo's on both ranks")
        (loss0, digest0), (loss1, digest1) = pool.run(ddp_csc, args.steps, timeout=600)
        print(f"DDP + CSC hook, {args.steps} steps: loss {loss0[0]:.4f} -> {loss0[-1]:.4f} "
              f"(rank 0), {loss1[0]:.4f} -> {loss1[-1]:.4f} (rank 1); parameter digest "
              f"rank 0 {digest0}, rank 1 {digest1}")
    finally:
        pool.close()
    if digest0 != digest1:
        print("FAILED: the ranks' parameters differ")
        return 1
    print("passed: parameters identical on every rank")
    return 0


if __name__ == "__main__":
    sys.exit(main())
