"""Measure a model's per-layer gradient sizes and compute times, and write them as a table.

The table (gradientflow/simulate/profiles.json) is what the cost model reads: for each layer with
parameters, in backward order, the number of gradient elements, how many of them sit in 1-D
tensors (biases, norms: CSC sends those dense), and the share of the backward pass spent
before that layer's gradient is ready; plus the forward share of a training step and the
forward order of the layers (which the next step's forward needs first).

Times come from hooks on a real fwd+bwd on this machine's CPU (torch.profiler would give the
same split at more cost): a forward pre/post hook per layer, and a post-accumulate-grad hook
per parameter that stamps when its gradient is ready. Shares, not milliseconds, go into the
table: the cost model scales them to a GPU with a stated per-GPU throughput.

    python -m gradientflow.simulate.profile [--models alexnet,resnet50,bert-base] [--reps 3]
        [--json FILE]

For your own model: json.dump(measure_module(net, example_batch, "mynet"), file), then
`python -m gradientflow.simulate --model file.json --batch B --throughput SAMPLES_PER_S ...`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

BERT = {"hidden": 768, "ff": 3072, "layers": 12, "heads": 12, "vocab": 30522, "positions": 512}


def _bert_base():
    """BERT-base built from plain nn modules, one Linear per Q, K, V and output projection."""
    import torch
    from torch import nn

    h, ff, heads = BERT["hidden"], BERT["ff"], BERT["heads"]

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))
            self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.ff1, self.ff2 = nn.Linear(h, ff), nn.Linear(ff, h)

        def forward(self, x):
            b, s, _ = x.shape

            def split(t):
                return t.view(b, s, heads, h // heads).transpose(1, 2)

            a = nn.functional.scaled_dot_product_attention(
                split(self.q(x)), split(self.k(x)), split(self.v(x)))
            x = self.ln1(x + self.o(a.transpose(1, 2).reshape(b, s, h)))
            return self.ln2(x + self.ff2(nn.functional.gelu(self.ff1(x))))

    class Bert(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(BERT["vocab"], h)
            self.pos = nn.Embedding(BERT["positions"], h)
            self.typ = nn.Embedding(2, h)
            self.ln = nn.LayerNorm(h)
            self.layers = nn.ModuleList(Layer() for _ in range(BERT["layers"]))
            self.pool = nn.Linear(h, h)

        def forward(self, ids):
            pos = torch.arange(ids.shape[1]).unsqueeze(0)
            x = self.ln(self.tok(ids) + self.pos(pos) + self.typ(torch.zeros_like(ids)))
            for layer in self.layers:
                x = layer(x)
            return torch.tanh(self.pool(x[:, 0]))

    return Bert()


def build(model: str, batch: int | None = None):
    """The module and one input batch for a model name (alexnet, resnet50, bert-base)."""
    import torch

    if model == "bert-base":
        return _bert_base(), torch.randint(0, BERT["vocab"], (batch or 2, 128))
    import torchvision

    # AlexNet at 64: at small batches its FC layers (whose weight gradients read and write the
    # whole 151 MB matrix whatever the batch) take a far larger share of backward than on a
    # GPU at the paper's batch of 128.
    batch = batch or {"alexnet": 64, "resnet50": 4}.get(model, 4)
    return getattr(torchvision.models, model)(), torch.randn(batch, 3, 224, 224)


def measure(model: str, reps: int = 3, batch: int | None = None) -> dict:
    """Per-layer sizes and time shares of one of our models (see build)."""
    import torch

    torch.manual_seed(0)
    net, x = build(model, batch)
    return measure_module(net, x, model, reps)


def measure_module(net, x, label: str = "custom", reps: int = 3) -> dict:
    """Per-layer sizes and time shares of any module on input `x`, medians over `reps` passes.

    The loss is the mean square of the output, so no labels are needed. The result is what
    `gradientflow.simulate.models.from_profile` (or a JSON file given to --model) reads.
    """
    import torch

    torch.set_num_threads(1)
    layers = [(n, m) for n, m in net.named_modules()
              if any(True for _ in m.parameters(recurse=False))]
    fwd_ms: dict[str, list[float]] = {n: [] for n, _ in layers}
    ready: dict[str, list[float]] = {n: [] for n, _ in layers}
    stamp: dict = {}

    def pre(name):
        return lambda *_: stamp.__setitem__(("f", name), time.perf_counter())

    def post(name):
        return lambda *_: stamp.__setitem__(("fe", name), time.perf_counter())

    def on_grad(name):
        return lambda *_: stamp.__setitem__(("g", name), time.perf_counter())

    for name, m in layers:
        m.register_forward_pre_hook(pre(name))
        m.register_forward_hook(post(name))
        for p in m.parameters(recurse=False):
            p.register_post_accumulate_grad_hook(on_grad(name))
    totals = []
    for rep in range(reps + 1):
        stamp.clear()
        t0 = time.perf_counter()
        out = net(x)
        t1 = time.perf_counter()
        out.float().pow(2).mean().backward()
        t2 = time.perf_counter()
        net.zero_grad(set_to_none=True)
        if rep == 0:
            continue  # warm-up: allocator and kernel selection
        totals.append((t1 - t0, t2 - t1))
        for name, _ in layers:
            fwd_ms[name].append(1e3 * (stamp[("fe", name)] - stamp[("f", name)]))
            ready[name].append((stamp[("g", name)] - t1) / (t2 - t1))
    fwd_s = statistics.median(f for f, _ in totals)
    bwd_s = statistics.median(b for _, b in totals)
    rows = []
    for name, m in layers:
        params = list(m.parameters(recurse=False))
        rows.append({
            "name": name,
            "numel": sum(p.numel() for p in params),
            "numel_1d": sum(p.numel() for p in params if p.dim() <= 1),
            "tensors": len(params),
            "ready": round(statistics.median(ready[name]), 5),
            "fwd_share": round(statistics.median(fwd_ms[name]) / (1e3 * fwd_s), 5),
        })
    forward_order = [r["name"] for r in rows]
    rows.sort(key=lambda r: r["ready"])  # backward order: the order gradients become ready
    return {
        "model": label,
        "batch": int(x.shape[0]),
        "cpu_fwd_ms": round(1e3 * fwd_s, 2),
        "cpu_bwd_ms": round(1e3 * bwd_s, 2),
        "forward_fraction": round(fwd_s / (fwd_s + bwd_s), 4),
        "forward_order": forward_order,
        "layers": rows,
    }


def write_tables(profiles: dict, path: Path) -> None:
    """Write the measured profiles as the JSON data file the cost model reads (models.py)."""
    doc = {"generated_by": "python -m gradientflow.simulate.profile",
           "description": ("Measured model profiles. Per layer in backward order: gradient "
                           "elements, elements in 1-D tensors, tensors, the share of backward "
                           "elapsed when its gradient is ready, and its share of forward."),
           "profiles": profiles}
    path.write_text(json.dumps(doc, indent=1) + "\n")


def main(argv=None) -> None:
    """Profile the models and rewrite profiles.json."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="alexnet,resnet50,bert-base")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).with_name("profiles.json")),
                    help="the data file to write (default: the package's own)")
    args = ap.parse_args(argv)
    profiles = {m: measure(m, args.reps) for m in args.models.split(",")}
    write_tables(profiles, Path(args.out))
    for m, p in profiles.items():
        print(m, sum(r["numel"] for r in p["layers"]), "elements;", len(p["layers"]), "layers;",
              f"fwd {p['cpu_fwd_ms']} ms, bwd {p['cpu_bwd_ms']} ms")


if __name__ == "__main__":
    main()
