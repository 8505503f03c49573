"""The compressed reduce-scatter FSDP2 is given, alone on 2 ranks: no gradient mass is lost.

Over a few steps, what each rank received (its piece of the average) plus every rank's residual
for that piece, divided by the world size, is the average of what was put in: within the wire's
rounding on an FP16 wire, within FP32's on an FP32 one. Hypothesis draws the parameters' shapes,
the method, the density and the inputs' scales; every rank runs the same examples (agreed by
all-gathering each one).
"""
from __future__ import annotations

import pytest


def reduce_scatter_property(rank, world, n_examples):
    """Rank body: random compressed reduce-scatters, each checked for conservation."""
    import torch
    import torch.distributed as dist
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    from gradientflow.compression import CompressionConfig
    from gradientflow.hooks.fsdp_comms import CompressedReduceScatter, Unit

    checked = []

    @settings(max_examples=n_examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 2**30), method=st.sampled_from(["fp16", "csc"]),
           wire=st.sampled_from(["fp16", "bf16", "fp32"]),
           density=st.sampled_from([1.0, 0.3, 0.05]),
           rows=st.lists(st.integers(1, 9), min_size=1, max_size=3),
           cols=st.integers(1, 12), scale=st.sampled_from([1e-6, 1.0, 1e3]),
           steps=st.integers(1, 3))
    def prop(seed, method, wire, density, rows, cols, scale, steps):
        ids = [None] * world
        dist.all_gather_object(ids, (seed, method, wire, density, rows, cols, scale, steps))
        assert all(i == ids[0] for i in ids), f"ranks run different examples: {ids}"
        if method == "fp16" and wire == "fp32":
            wire = "fp16"
        csc = (dict(density=density, chunk_size=4, min_numel=0, warmup_densities=())
               if method == "csc" else {})  # the other methods have none of these options
        cfg = CompressionConfig(method=method, wire_dtype=wire, **csc)
        # Each parameter's rows padded to a multiple of the world size, as FSDP pads them.
        pieces = [(f"p{i}", (-(-r // world), cols) if i % 2 == 0 else (-(-r // world) * cols,))
                  for i, r in enumerate(rows)]
        unit = Unit("layer", pieces, world, rank, 1, cfg)
        comm = CompressedReduceScatter(unit, lambda: None)
        numel = unit.full_layout.numel
        piece = numel // world
        g = torch.Generator().manual_seed(seed)
        sent_in = torch.zeros(numel, dtype=torch.float64)
        received = torch.zeros(piece, dtype=torch.float64)
        for _ in range(steps):
            xs = [torch.randn(numel, generator=g) * scale for _ in range(world)]
            for x in xs:
                sent_in += x.double() / world
            out = torch.empty(piece)
            comm(out, xs[rank].clone(), dist.group.WORLD, dist.ReduceOp.AVG)
            received += out.double()
        comp = unit.rs
        # One FP32 copy of the group's unsharded gradient: the residual, no spare beside it.
        assert comp.memory.nbytes() == 4 * numel, (
            f"rank {rank}: {method} keeps {comp.memory.nbytes()} bytes of state for {numel} "
            "elements (one FP32 copy is the floor)")
        res = comp.memory.get(unit.full_layout, ("residual",), out)["residual"]
        everyone = [torch.empty_like(res) for _ in range(world)]
        dist.all_gather(everyone, res.contiguous())
        waiting = sum(r.double() for r in everyone) / world
        mine = slice(rank * piece, (rank + 1) * piece)
        total = received + waiting[mine]
        want = sent_in[mine]
        tol = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 2e-2}[wire] * scale * steps * world
        err = float((total - want).abs().max())
        assert err <= tol, (f"rank {rank}: {method} on {wire} at density {density} lost "
                            f"{err:.3g} (> {tol:.3g}) of the gradient")
        checked.append(method)

    prop()
    return len(checked)


@pytest.mark.parametrize("n_examples", [20])
def test_compressed_reduce_scatter_loses_no_gradient_mass(pools, n_examples):
    counts = pools(2).run(reduce_scatter_property, n_examples, timeout=240)
    assert counts == [n_examples, n_examples]
