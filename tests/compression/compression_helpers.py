"""Helpers for the compression tests: random layouts, N simulated ranks, totals by parameter
name."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, settings, strategies as st

from gradientflow.compression import CompressionConfig, Layout, make_compressor
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


def wire_eps(dtype: str) -> float:
    return {"fp32": 2.0 ** -23, "fp16": 2.0 ** -10, "bf16": 2.0 ** -7}[dtype]


def lost_tolerance(cfg: CompressionConfig, world: int, steps: int, vmax: float) -> float:
    """Bound on what the transport's own rounding of the SUM may change (nothing else may be lost).

    Each step the wire sum of `world` pre-scaled terms rounds each partial sum once (relative
    eps of the wire type, on values up to vmax); applied values are multiplied back by world.
    """
    eps = max(wire_eps(cfg.wire_dtype), wire_eps(cfg.dense_wire_dtype or cfg.wire_dtype), 2.0**-22)
    return 4 * steps * world * world * eps * vmax + 1e-5 * steps * vmax


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
