"""Triton CSC kernels against the torch reference, on CPU tensors through Triton's interpreter.

tests/conftest.py sets TRITON_INTERPRET=1 on a machine without a GPU, before Triton is first
imported; on a GPU machine this module is skipped and tests/gpu runs the same comparisons on
CUDA tensors, compiled. Same contract as the other kernels: norms within float accumulation
error, every other output bit for bit (any NaN matching any NaN).
"""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradientflow.kernels import reference as R

from .conftest import assert_same_bits

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton compiles for the GPU here (tests/gpu checks it)", allow_module_level=True)

from gradientflow.kernels import triton_kernels as T  # noqa: E402

WIRES = [torch.float32, torch.float16, torch.bfloat16]
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def layouts(draw):
    """(N, C): up to a few thousand elements, chunks from 1 to larger than N, powers of two or
    not (the kernels tile columns by powers of two and loop past 1024)."""
    n = draw(st.integers(0, 3000))
    c = draw(st.sampled_from([1, 3, 16, 100, 256, 1024, 1500, 5000]))
    return n, c


def _vec(seed: int, n: int, specials: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    if specials and n:
        # magnitudes that overflow binary16, land in its subnormals, or underflow to zero
        x = x * torch.pow(2.0, torch.randint(-30, 20, (n,), generator=g).float())
        special = torch.tensor([float("inf"), -float("inf"), float("nan"), 65504.0, 65520.0,
                                -0.0, 1e-40])
        x[: min(n, special.numel())] = special[: min(n, special.numel())]
    return x


@SETTINGS
@given(lay=layouts(), norm=st.sampled_from(["l1", "l2"]), has_r=st.booleans(),
       mode=st.sampled_from(["plain", "momentum", "nesterov"]), alias=st.booleans(),
       v_out=st.booleans(), seed=st.integers(0, 2**16))
def test_chunk_norms(lay, norm, has_r, mode, alias, v_out, seed):
    n, c = lay
    grad, res, mom = _vec(seed, n), _vec(seed + 1, n) if has_r else None, _vec(seed + 2, n)
    outs = []
    for fn in (T.chunk_norms, R.chunk_norms):
        g = grad.clone()
        kw = {}
        if mode != "plain":
            m_in = mom.clone()
            kw = dict(momentum=m_in, momentum_out=m_in if alias else torch.empty(n), m=0.9,
                      nesterov=mode == "nesterov")
        spare = torch.empty(n) if v_out else None
        norms = fn(g, res, c, norm, v_out=spare, zero_grad=v_out, **kw)
        outs.append((g, spare, kw.get("momentum_out"), norms))
    (g_t, v_t, m_t, n_t), (g_r, v_r, m_r, n_r) = outs
    assert_same_bits(g_t, g_r)
    if v_out:
        assert_same_bits(v_t, v_r)
    if mode != "plain":
        assert_same_bits(m_t, m_r)
    torch.testing.assert_close(n_t, n_r, rtol=1e-5, atol=1e-4)


@SETTINGS
@given(nch=st.integers(0, 3000), data=st.data(), seed=st.integers(0, 2**16))
def test_select_chunks(nch, data, seed):
    """Exactly the reference's choice: ties to the lower index, NaN and inf first."""
    g = torch.Generator().manual_seed(seed)
    # few distinct values, so that ties at the k-th norm are common
    norms = torch.randint(0, 6, (nch,), generator=g).float()
    if nch:
        special = torch.tensor([float("nan"), float("inf"), float("nan")])
        where = torch.randint(0, nch, (3,), generator=g)
        norms[where] = special
    k = data.draw(st.integers(0, nch))
    assert torch.equal(T.select_chunks(norms, k), R.select_chunks(norms, k))


@SETTINGS
@given(nch=st.integers(0, 700), seed=st.integers(0, 2**16), data=st.data())
def test_select_chunks_over_many_blocks(nch, seed, data, small_select_blocks):
    """Small blocks, so that a selection spans many of them and each program scans the
    others' counts in several reads."""
    g = torch.Generator().manual_seed(seed)
    norms = torch.randint(0, 4, (nch,), generator=g).float()
    k = data.draw(st.integers(0, nch))
    assert torch.equal(T.select_chunks(norms, k), R.select_chunks(norms, k))


@pytest.fixture(scope="module")
def small_select_blocks():
    saved = T._SELECT_BLOCK, T._SELECT_SCAN
    T._SELECT_BLOCK, T._SELECT_SCAN = 16, 4
    yield
    T._SELECT_BLOCK, T._SELECT_SCAN = saved


def _factor(x: float, as_tensor: bool):
    """A scale factor as a number or as a one-element float32 tensor (read by the kernel)."""
    return torch.tensor([x], dtype=torch.float32) if as_tensor else x


@SETTINGS
@given(lay=layouts(), wire=st.sampled_from(WIRES), seed=st.integers(0, 2**16),
       has_r=st.booleans(), has_loc=st.booleans(), alias=st.booleans(), tensors=st.booleans(),
       data=st.data())
def test_pack_unpack(lay, wire, seed, has_r, has_loc, alias, tensors, data):
    n, c = lay
    v = _vec(seed, n, specials=True) * 100
    nch = R.nchunks_of(n, c)
    k = data.draw(st.sampled_from(sorted({0, 1, nch // 3, nch} & set(range(nch + 1)))))
    perm = torch.randperm(nch, generator=torch.Generator().manual_seed(seed))
    idx = torch.sort(perm[:k]).values
    packed = T.pack_chunks(v, idx, c, _factor(0.5, tensors), wire,
                           out=torch.empty(k * c, dtype=wire))
    ref = R.pack_chunks(v, idx, c, 0.5, wire)
    assert_same_bits(packed, ref)
    red = (ref.float() * 2).to(wire)  # stands in for the reduced buffer
    local = ref if has_loc else None
    # unpack_sent: only the sent chunks of out and of the residual change
    res = []
    for fn in (T.unpack_sent, R.unpack_sent):
        out = torch.full((n,), 3.0)
        r = _vec(seed + 5, n) if has_r else None
        mine = fn is T.unpack_sent and tensors
        fn(out, r, red, local, idx, c, _factor(0.25, mine), _factor(2.0, mine))
        res.append((out, r))
    assert_same_bits(res[0][0], res[1][0])
    if has_r:
        assert_same_bits(res[0][1], res[1][1])
    # unpack_update: the whole buffer in one pass, out possibly aliasing v
    res = []
    for fn in (T.unpack_update, R.unpack_update):
        vi = v.clone()
        r = torch.full((n,), 7.0) if has_r else None
        out = vi if alias else torch.empty(n)
        mine = fn is T.unpack_update and tensors
        fn(vi, r, red, local, idx, c, _factor(0.25, mine), _factor(2.0, mine), out=out)
        res.append((out, r))
    assert_same_bits(res[0][0], res[1][0])
    if has_r:
        assert_same_bits(res[0][1], res[1][1])


@SETTINGS
@given(n=st.integers(0, 10_000), wire=st.sampled_from(WIRES), seed=st.integers(0, 2**16),
       tensors=st.booleans())
def test_cast_and_upcast(n, wire, seed, tensors):
    x = _vec(seed, n, specials=True)
    cast = T.cast_scaled(x, _factor(0.25, tensors), wire, out=torch.empty(n, dtype=wire))
    assert_same_bits(cast, R.cast_scaled(x, 0.25, wire))
    up = T.upcast_scaled(cast, _factor(4.0, tensors), out=torch.empty(n))
    assert_same_bits(up, R.upcast_scaled(cast, 4.0, out=torch.empty(n)))
