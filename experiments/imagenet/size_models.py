"""How the comparison's two models were sized: compute per step against gradient bytes.

    python experiments/imagenet/size_models.py            # the two models as committed
    python experiments/imagenet/size_models.py --widths 8,16,32 --batch 64

For each model: parameters, the share in fully connected layers, gradient tensors, the
gradient's FP32 bytes, the CPU time of one training step of one rank (one thread, the
per-rank batch, median of --reps; CPU time, not wall time, so that other jobs on the machine
move it less), and the time a 2-rank ring allreduce of the gradient takes on 1 and 10 Gbit/s
(bytes x 8 / rate: each rank sends and receives the gradient once). Their ratio is what
communication can cost a dense step and so what compression can win.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models  # noqa: E402


def measure(model: torch.nn.Module, batch: int, reps: int) -> dict:
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    fc = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)
             for p in m.parameters())
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=5e-4)
    cpu = []
    for i in range(reps + 3):  # three to warm up
        t = time.process_time()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if i >= 3:
            cpu.append(time.process_time() - t)
    step = statistics.median(cpu)
    grad = 4 * n
    return {"params": n, "fc_share": fc / n, "tensors": len(params), "grad_bytes": grad,
            "step_s": step, "comm_1g_s": grad * 8 / 1e9, "comm_10g_s": grad * 8 / 1e10}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64, help="per-rank batch (compare.py: 64)")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--widths", default=None, help="also the ResNet-shaped at these widths")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # what each rank gets (OMP_NUM_THREADS=1)
    torch.manual_seed(0)
    cands = {"alexnet_shaped": models.alexnet_shaped(), "resnet_shaped": models.resnet_shaped()}
    for w in (args.widths.split(",") if args.widths else []):
        cands[f"resnet_shaped width {w}"] = models.resnet_shaped(width=int(w))
    print(f"per-rank batch {args.batch}, one thread; load average {__import__('os').getloadavg()}")
    print("| model | parameters | in FC layers | tensors | gradient MB | compute ms/step (CPU) "
          "| allreduce 1 Gbit/s ms | ratio | 10 Gbit/s ms | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, model in cands.items():
        r = measure(model, args.batch, args.reps)
        print(f"| {name} | {r['params'] / 1e6:.2f} M | {r['fc_share']:.0%} | {r['tensors']} | "
              f"{r['grad_bytes'] / 1e6:.1f} | {1e3 * r['step_s']:.0f} | "
              f"{1e3 * r['comm_1g_s']:.0f} | {r['comm_1g_s'] / r['step_s']:.1f} | "
              f"{1e3 * r['comm_10g_s']:.1f} | {r['comm_10g_s'] / r['step_s']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
