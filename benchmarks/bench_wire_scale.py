"""FP16 wire underflow: torch's fp16_compress_hook against gradientflow's scaled FP16 wire.

A 13-layer ReLU MLP at PyTorch's default init has first-layer gradients below FP16's normal
range. For n simulated ranks (different data each), the average gradient is computed exactly
(FP64), as torch's fp16_compress_hook sends it (cast to FP16, divide by n, FP16 sum), and as
gradientflow's FP16 and CSC (density 1) compressors send it with the agreed power-of-two scale
(gradientflow/compression/wire_scale.py). Reported: relative L2 error of the first layer's
weight gradient and of all gradients, medians over seeds. No timing: the numbers do not depend
on the machine.

    python benchmarks/bench_wire_scale.py [--quick] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import markdown_table, median, write_result  # noqa: E402

LAYERS, WIDTH, BATCH = 13, 256, 32


def _grads(world: int, seed: int) -> tuple[list[torch.Tensor], list[tuple[str, tuple]]]:
    """Each rank's flat gradient of the MLP (same weights, its own batch), and the shapes."""
    torch.manual_seed(seed)
    layers = []
    for _ in range(LAYERS - 1):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 1))
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    out = []
    for rank in range(world):
        g = torch.Generator().manual_seed(seed * 1000 + rank)
        x = torch.randn(BATCH, WIDTH, generator=g)
        y = torch.randn(BATCH, 1, generator=g)
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        out.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
    return out, shapes


def _torch_hook(grads: list[torch.Tensor]) -> torch.Tensor:
    """What torch's fp16_compress_hook delivers: FP16(g) / n summed in FP16, back to FP32."""
    n = len(grads)
    acc = None
    for g in grads:
        w = g.to(torch.float16).div_(n)
        acc = w if acc is None else acc + w
    return acc.to(torch.float32)


def _ours(grads, shapes, method: str) -> torch.Tensor:
    from gradientflow.compression import CompressionConfig, Layout, make_compressor
    from gradientflow.engine.stages import drive_lockstep

    n = len(grads)
    layout = Layout.from_shapes(shapes)
    csc = dict(density=1.0, warmup_densities=()) if method == "csc" else {}
    cfg = CompressionConfig(method=method, error_feedback=False, **csc)
    comps = [make_compressor(cfg, n) for _ in range(n)]
    return drive_lockstep([c.reduce(g.clone(), layout) for c, g in zip(comps, grads)])[0]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def main(argv=None) -> int:
    """Run the comparison; print and write the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 seeds, 2 ranks")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "wire_scale"))
    args = ap.parse_args(argv)
    seeds = range(3) if args.quick else range(10)
    worlds = (2,) if args.quick else (2, 4, 8)
    rows = []
    for world in worlds:
        errs: dict[str, list] = {}
        for seed in seeds:
            grads, shapes = _grads(world, seed)
            first = shapes[0][1][0] * shapes[0][1][1]
            exact = torch.stack([g.double() for g in grads]).sum(0) / world
            for name, got in (("torch fp16_compress_hook", _torch_hook(grads)),
                              ("gradientflow fp16", _ours(grads, shapes, "fp16")),
                              ("gradientflow csc (density 1)", _ours(grads, shapes, "csc"))):
                e = errs.setdefault(name, [[], [], []])
                e[0].append(_rel(got[:first], exact[:first]))
                e[1].append(_rel(got, exact))
                e[2].append(float((got[:first] == 0).double().mean()))
            e = errs.setdefault("first-layer |grad| median", [[], [], []])
            e[0].append(float(exact[:first].abs().median()))
        for name, (first_err, all_err, zeros) in errs.items():
            if name.startswith("first-layer"):
                continue
            rows.append({"ranks": world, "wire": name,
                         "first-layer rel. L2 error": median(first_err),
                         "all-layers rel. L2 error": median(all_err),
                         "first-layer zeros": median(zeros)})
        rows.append({"ranks": world, "wire": "(first-layer |avg grad|, median)",
                     "first-layer rel. L2 error": median(errs["first-layer |grad| median"][0]),
                     "all-layers rel. L2 error": float("nan"), "first-layer zeros": float("nan")})
    cols = ["ranks", "wire", "first-layer rel. L2 error", "all-layers rel. L2 error",
            "first-layer zeros"]
    table = markdown_table(cols, rows)
    md = (f"## FP16 wire underflow ({LAYERS}-layer ReLU MLP, width {WIDTH}, default init, "
          f"batch {BATCH} per rank; medians over {len(seeds)} seeds)\n\n{table}\n")
    print(md)
    write_result(args.out, "wire_scale", {"rows": rows, "layers": LAYERS, "width": WIDTH,
                                          "seeds": len(seeds)}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
