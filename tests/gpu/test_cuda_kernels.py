"""The CUDA kernels (Triton and numba) on real CUDA tensors vs the torch reference on the device.

The simulator and interpreter tests (tests/kernels/test_cuda_sim.py, test_triton.py) run them
without a GPU; these drive the dispatch (``impl="triton"`` or ``"numba"`` vs ``impl="torch"``)
on torch CUDA tensors, on torch's current stream. Same contract as the CPU kernels: norms
within float accumulation error, every other output bit for bit. Skipped without a GPU
(tests/gpu/conftest.py).
"""
from __future__ import annotations

import pytest
import torch
from bits import assert_same_bits
from hypothesis import given, settings
from hypothesis import strategies as st

from gradientflow import kernels as K

DEV = "cuda"
WIRES = (torch.float32, torch.float16, torch.bfloat16)
IMPLS = ("triton", "numba")


def _special(n: int, gen: torch.Generator) -> torch.Tensor:
    """A gradient with large values, infinities, NaN, subnormals and FP16 overflow in front."""
    v = torch.randn(n, generator=gen) * 100
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 65504.0,
                            65520.0, 1e-8, 6e-8, 3e5, -3e5, 1e-40])
    m = min(n, special.numel())
    v[:m] = special[:m]
    return v.to(DEV)


def test_triton_kernels_load_and_are_used():
    """On a GPU machine the dispatch must pick Triton's kernels, then numba's, then torch."""
    tri, nb = K._triton(), K._cuda()
    assert tri is not None, f"Triton kernels unavailable: {K.triton_error()!r}"
    assert nb is not None, f"numba CUDA kernels unavailable: {K.cuda_error()!r}"
    for op, spec in K.OPS.items():
        want = (getattr(tri, op) if spec.triton else getattr(nb, op) if spec.cuda
                else spec.reference)
        assert K.implementation(op, "auto", torch.device(DEV)) is want, op


def test_views_are_zero_copy():
    """The numba view of a tensor is the tensor's own memory (no copy, float16 as uint16 bits)."""
    from gradientflow.kernels import cuda as KC

    for dtype in WIRES:
        t = torch.zeros(1000, dtype=dtype, device=DEV)
        a = KC._arr(t)
        assert a.__cuda_array_interface__["data"][0] == t.data_ptr()
        assert a.shape == (1000,)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n,c", [(1, 4), (13, 3), (1000, 16), (4099, 1024), (300_000, 1024)])
@pytest.mark.parametrize("mode", ["plain", "momentum", "nesterov"])
@pytest.mark.parametrize("norm", ["l1", "l2"])
@pytest.mark.parametrize("has_r", [False, True])
def test_chunk_norms(impl, n, c, mode, norm, has_r):
    gen = torch.Generator().manual_seed(n * 7 + c)
    g = torch.randn(n, generator=gen).to(DEV)
    g[: min(n, 3)] *= 1e3
    r = torch.randn(n, generator=gen).to(DEV) if has_r else None
    mom = torch.randn(n, generator=gen).to(DEV) if mode != "plain" else None
    kw = {}
    outs = []
    for which in (impl, "torch"):
        gi = g.clone()
        mo = torch.empty(n, device=DEV) if mom is not None else None
        if mom is not None:
            kw = dict(momentum=mom, momentum_out=mo, m=0.9, nesterov=mode == "nesterov")
        norms = K.chunk_norms(gi, r, c, norm, impl=which, **kw)
        outs.append((gi, mo, norms))
    (g_n, mo_n, nr_n), (g_t, mo_t, nr_t) = outs
    assert_same_bits(g_n, g_t)
    if mom is not None:
        assert_same_bits(mo_n, mo_t)
    torch.testing.assert_close(nr_n, nr_t, rtol=2e-5, atol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n,c", [(1, 4), (13, 3), (1000, 16), (300_001, 1024)])
@pytest.mark.parametrize("wire", WIRES)
def test_pack_unpack_cast_upcast(impl, n, c, wire):
    gen = torch.Generator().manual_seed(n + c)
    v = _special(n, gen)
    nch = K.nchunks_of(n, c)
    for k in sorted({0, 1, max(1, nch // 3), nch}):
        idx = torch.sort(torch.randperm(nch, generator=gen)[:k]).values.to(DEV)
        p_n = K.pack_chunks(v, idx, c, 0.5, wire, impl=impl)
        p_t = K.pack_chunks(v, idx, c, 0.5, wire, impl="torch")
        assert_same_bits(p_n, p_t)
        red = (p_t.float() * 2).to(wire)  # stands in for the reduced buffer
        for has_r in (False, True):
            for has_loc in (False, True):
                for alias in ((False, True) if has_r and has_loc else (False,)):
                    res = []
                    for which in (impl, "torch"):
                        vi = v.clone()
                        r = torch.full((n,), 7.0, device=DEV) if has_r else None
                        out = vi if alias else torch.empty(n, device=DEV)
                        K.unpack_update(vi, r, red, p_t if has_loc else None, idx, c, 0.25, 2.0,
                                        out=out, impl=which)
                        res.append((out, r))
                    assert_same_bits(res[0][0], res[1][0])
                    if has_r:
                        assert_same_bits(res[0][1], res[1][1])
    c_n = K.cast_scaled(v, 0.25, wire, impl=impl)
    c_t = K.cast_scaled(v, 0.25, wire, impl="torch")
    assert_same_bits(c_n, c_t)
    up_n = K.upcast_scaled(c_t, 4.0, out=torch.empty(n, device=DEV), impl=impl)
    up_t = K.upcast_scaled(c_t, 4.0, out=torch.empty(n, device=DEV), impl="torch")
    assert_same_bits(up_n, up_t)


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 5000), c=st.sampled_from([1, 3, 16, 100, 256, 300]),
       density=st.floats(0.0, 1.0), wire=st.sampled_from(WIRES),
       seed=st.integers(0, 2**31 - 1), mode=st.sampled_from(["plain", "momentum", "nesterov"]))
def test_csc_step_property(impl, n, c, density, wire, seed, mode):
    """A whole CSC step on random sizes: the CUDA kernels and the torch reference agree bit for
    bit (the selection exactly; the norms only within rounding). Chunk sizes from a few values:
    each new tile shape is a Triton compile."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, generator=gen).to(DEV) * 10
    r0 = torch.randn(n, generator=gen).to(DEV)
    mom = torch.randn(n, generator=gen).to(DEV) if mode != "plain" else None
    nch = K.nchunks_of(n, c)
    k = round(density * nch)
    state = {}
    for which in (impl, "torch"):
        gi, r = g.clone(), r0.clone()
        kw = {}
        if mom is not None:
            kw = dict(momentum=mom, momentum_out=torch.empty(n, device=DEV), m=0.9,
                      nesterov=mode == "nesterov")
        norms = K.chunk_norms(gi, r, c, "l1", impl=which, **kw)
        state[which] = (gi, r, norms)
    torch.testing.assert_close(state[impl][2], state["torch"][2], rtol=2e-5, atol=1e-4)
    idx = K.select_chunks(state["torch"][2], k, impl="torch")
    assert torch.equal(K.select_chunks(state["torch"][2], k, impl=impl), idx)
    for which in (impl, "torch"):
        gi, r, _ = state[which]
        packed = K.pack_chunks(gi, idx, c, 0.5, wire, impl=which)
        local = packed.clone()
        K.unpack_update(gi, r, packed, local, idx, c, 2.0, 2.0, out=gi, impl=which)
    assert_same_bits(state[impl][0], state["torch"][0])
    assert_same_bits(state[impl][1], state["torch"][1])


@pytest.mark.parametrize("impl", IMPLS)
def test_kernels_run_on_the_current_stream(impl):
    """Inputs written on a side stream and the kernels launched under it: the results are right
    only if the kernels are ordered on that stream (the wrappers never synchronise)."""
    n, c = 4 * 1024 * 1024, 1024
    s = torch.cuda.Stream()
    expect_g = torch.arange(n, dtype=torch.float32, device=DEV).remainder_(977).sub_(488)
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        for _ in range(5):
            g = torch.empty(n, device=DEV)
            torch.cuda._sleep(2_000_000)  # keep the stream busy: a launch elsewhere would race
            g.copy_(expect_g)
            norms = K.chunk_norms(g, None, c, "l1", impl=impl)
            idx = K.select_chunks(norms, 100, impl=impl)
            packed = K.pack_chunks(g, idx, c, 1.0, torch.float32, impl=impl)
            out = torch.empty(n, device=DEV)
            K.unpack_update(g, None, packed, None, idx, c, 1.0, 1.0, out=out, impl=impl)
    s.synchronize()
    ref = K.chunk_norms(expect_g.clone(), None, c, "l1", impl="torch")
    torch.testing.assert_close(norms, ref, rtol=2e-5, atol=1e-3)
    ref_idx = K.select_chunks(ref, 100, impl="torch")
    assert torch.equal(idx, ref_idx)
    mask = torch.zeros(n, dtype=torch.bool, device=DEV)
    mask.view(-1, c)[idx] = True
    assert torch.equal(out[mask], expect_g[mask])
    assert bool((out[~mask] == 0).all())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("wire", WIRES)
def test_csc_step_with_v_in_the_spare_buffer(impl, wire):
    """The compressor's step with error feedback: v written into a spare buffer with the gradient
    zeroed in the same pass (chunk_norms(v_out=, zero_grad=True)), then only the sent chunks
    written back (unpack_sent): numba CUDA and torch agree bit for bit."""
    n, c = 300_001, 1024
    gen = torch.Generator().manual_seed(5)
    g0 = torch.randn(n, generator=gen).to(DEV)
    r0 = torch.randn(n, generator=gen).to(DEV)
    nch = K.nchunks_of(n, c)
    res = {}
    for which in (impl, "torch"):
        g, r, spare = g0.clone(), r0.clone(), torch.empty(n, device=DEV)
        norms = K.chunk_norms(g, r, c, "l1", v_out=spare, zero_grad=True, impl=which)
        assert bool((g == 0).all())
        idx = K.select_chunks(norms, nch // 10, impl=which)
        packed = K.pack_chunks(spare, idx, c, 0.5, wire, impl=which)
        K.unpack_sent(g, spare, packed, packed.clone(), idx, c, 2.0, 2.0, impl=which)
        res[which] = (g, spare, idx)
    assert torch.equal(res[impl][2], res["torch"][2])
    assert_same_bits(res[impl][0], res["torch"][0])
    assert_same_bits(res[impl][1], res["torch"][1])
