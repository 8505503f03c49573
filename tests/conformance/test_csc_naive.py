"""CSC against a deliberately naive reference written from the algorithm's description alone.

Per element and per chunk, in plain Python: v = grad + residual on every rank; each chunk's
norm summed over ranks; the top-k chunks (ties to the lower index) sent as the average; the
rest kept in the residual. Independent of kernels/ and of kernels/reference.py. Whole steps on
several simulated ranks (engine.stages.drive_lockstep sums each stage as a transport would).
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from gradientflow.compression import CompressionConfig, Layout, make_compressor
from gradientflow.engine.stages import drive_lockstep

pytestmark = pytest.mark.timeout(600)


def naive_step(grads: list[list[float]], residuals: list[list[float]], chunk: int,
               density: float, norm: str) -> tuple[list[float], list[list[float]]]:
    """One CSC step for all ranks: (the averaged output, each rank's new residual)."""
    n, numel = len(grads), len(grads[0])
    v = [[grads[r][i] + residuals[r][i] for i in range(numel)] for r in range(n)]
    nch = math.ceil(numel / chunk)
    total = []
    for c in range(nch):
        s = 0.0
        for r in range(n):
            for i in range(c * chunk, min(numel, (c + 1) * chunk)):
                s += abs(v[r][i]) if norm == "l1" else v[r][i] * v[r][i]
        total.append(s)
    k = min(nch, max(1, math.ceil(density * nch)))
    chosen = set(sorted(range(nch), key=lambda c: (-total[c], c))[:k])
    out = [0.0] * numel
    new_res = [list(row) for row in v]
    for i in range(numel):
        if i // chunk in chosen:
            out[i] = sum(v[r][i] for r in range(n)) / n
            for r in range(n):
                new_res[r][i] = 0.0
    return out, new_res


@settings(deadline=None, max_examples=15)
@given(n=st.integers(2, 4), numel=st.integers(1, 300), chunk=st.sampled_from([1, 7, 32]),
       density=st.sampled_from([0.05, 0.3, 1.0]), norm=st.sampled_from(["l1", "l2"]),
       seed=st.integers(0, 2**16))
def test_csc_matches_the_naive_reference_over_steps(n, numel, chunk, density, norm, seed):
    cfg = CompressionConfig(method="csc", density=density, chunk_size=chunk, norm=norm,
                            wire_dtype="fp32", warmup_densities=(), dense_1d=False, min_numel=0,
                            momentum_correction=False)
    layout = Layout.from_shapes([("w", (numel,))])
    comps = [make_compressor(cfg, n) for _ in range(n)]
    g = torch.Generator().manual_seed(seed)
    residuals = [[0.0] * numel for _ in range(n)]
    for step in range(4):
        grads = [torch.randn(numel, generator=g) for _ in range(n)]
        outs = drive_lockstep([c.reduce(t.clone(), layout) for c, t in zip(comps, grads)])
        for c in comps:
            c.end_step()
        want, residuals = naive_step([t.tolist() for t in grads], residuals, chunk, density,
                                     norm)
        want_t = torch.tensor(want, dtype=torch.float64)
        scale = 1.0 + float(want_t.abs().max())
        for r, out in enumerate(outs):
            err = float((out.double() - want_t).abs().max())
            assert err <= 1e-5 * scale, f"step {step}, rank {r}: output differs by {err}"
            state = comps[r].memory.state_dict().get("residual", {}).get("w")
            got = state.reshape(-1).double() if state is not None else torch.zeros(numel)
            # Sent elements keep only FP32's rounding error of v / n in the residual.
            res_err = float((got - torch.tensor(residuals[r], dtype=torch.float64)).abs().max())
            assert res_err <= 1e-5 * scale, f"step {step}, rank {r}: residual off by {res_err}"
