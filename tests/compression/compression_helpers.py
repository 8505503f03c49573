"""Helpers for the compression tests: random layouts, N simulated ranks, totals by parameter
name."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, settings, strategies as st

from gradientflow.compression import CompressionConfig, Layout, lookup, make_compressor
from gradientflow.engine.stages import drive_lockstep

# Applied per test, not as a global profile, so other test directories keep their own settings.
# No deadline: the first example of a run pays for numba's kernel loading.
SETTINGS = settings(deadline=None, max_examples=40,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def layouts(draw, max_params: int = 5, max_numel: int = 700):
    """A layout mixing matrices (sparsified) and vectors (sent dense), in random order."""
    n = draw(st.integers(1, max_params))
    shapes = []
    for i in range(n):
        if draw(st.booleans()):
            shapes.append((f"v{i}", (draw(st.integers(1, 60)),)))
        else:
            shapes.append(
                (f"w{i}", (draw(st.integers(1, 30)), draw(st.integers(1, max_numel // 30))))
            )
    return Layout.from_shapes(shapes)


def method_config(method: str, *, wire_dtype=None, error_feedback: bool = True,
                  **options) -> CompressionConfig:
    """A config of `method` with those of `options` the method has (a test that sweeps methods
    gives CSC's options to every method; the others have none of them)."""
    own = lookup(method).options.names()
    return CompressionConfig(method=method, wire_dtype=wire_dtype, error_feedback=error_feedback,
                             **{k: v for k, v in options.items() if k in own})


def make_ranks(cfg: CompressionConfig, world: int):
    return [make_compressor(cfg, world) for _ in range(world)]


def step(comps, layout, grads, loss_scale: float = 1.0, recorder=None):
    """Run one step on every simulated rank; return the per-rank outputs (fresh tensors)."""
    gens = [c.reduce(g.clone(), layout, loss_scale=loss_scale) for c, g in zip(comps, grads)]
    if recorder is not None:
        gens = [recorder(g, i) for i, g in enumerate(gens)]
    outs = drive_lockstep(gens)
    for c in comps:
        c.end_step()
    return outs


def flat_slot(comp, layout, slot: str = "residual") -> torch.Tensor:
    """A rank's slot (unscaled) laid out as `layout`, float64; zeros where it holds nothing."""
    out = torch.zeros(layout.numel, dtype=torch.float64)
    sd = comp.memory.state_dict().get(slot, {})
    for name, s, e in layout.slices():
        if name in sd:
            out[s:e] = sd[name].reshape(-1).double()
    return out


def unit_roundoff(dtype: str) -> float:
    """Largest relative error of one rounding to `dtype` (half its machine epsilon)."""
    return {"fp32": 2.0 ** -24, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8}[dtype]


def lost_tolerance(cfg: CompressionConfig, world: int, sent_abs: torch.Tensor) -> torch.Tensor:
    """Per element, a bound on what the transport's rounding of the SUM may lose (nothing else
    may be lost); `sent_abs` is sum over steps and ranks of |v|, v = gradient + residual, what a
    rank could send of that element in a step.

    The cast to the wire dtype loses nothing: its error stays in the residual (error feedback),
    and the agreed wire scale is a power of two. The wire SUM of `world` terms rounds each
    partial sum after the first once (unit roundoff u, relative): at most (world - 1) u sum|x|,
    x the wire values. Scaled back to the gradient's units that is (world - 1) u sum_ranks |v|
    per step (to first order; the residual update and the scales add a few fp32 roundings).
    At 4 ranks and 5 steps on a bf16 wire: 3 * 2^-8 of 20 terms |v|, about a quarter of one
    typical |v|, while a lost chunk leaves out its |v| whole (a per-example bound of 62.5 at
    |sums| below 20 let that pass).
    """
    dense = getattr(cfg, "dense_wire_dtype", None)  # CSC's option
    u = max(unit_roundoff(cfg.wire_dtype), unit_roundoff(dense or cfg.wire_dtype))
    return ((world - 1) * u * (1 + world * u) + 8 * 2.0 ** -24) * sent_abs + 1e-12


def grads_for(world: int, numel: int, seed: int, scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen) * scale for _ in range(world)]


def recording():
    """A generator wrapper that records every tensor a rank yields (dtype, numel, copy before
    reduce)."""
    log: dict[int, list] = {}

    def wrap(gen, rank):
        sent = log.setdefault(rank, [])
        try:
            t = next(gen)
            while True:
                sent.append(t.clone())
                reduced = yield t
                t = gen.send(reduced)
        except StopIteration as stop:
            return stop.value

    return wrap, log


def nchunks(numel: int, c: int) -> int:
    return math.ceil(numel / c)


class FakeBucket:
    """The part of DDP's GradBucket a hook uses: `grads` back to back (default: the parameters'
    .grad), copied."""

    def __init__(self, index, params, last, grads=None):
        self._index, self._params, self._last = index, params, last
        grads = [p.grad for p in params] if grads is None else grads
        self._buffer = torch.cat([g.reshape(-1) for g in grads])

    def index(self):
        return self._index

    def buffer(self):
        return self._buffer

    def parameters(self):
        return self._params

    def is_last(self):
        return self._last

    def write_back(self, result):
        off = 0
        for p in self._params:
            p.grad.copy_(result[off:off + p.numel()].view_as(p))
            off += p.numel()
