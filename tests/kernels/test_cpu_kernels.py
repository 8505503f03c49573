"""numba CPU kernels against the torch reference: random sizes, chunks, norms and wire types."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradientflow import kernels as K
from gradientflow.kernels import reference as R

from .conftest import assert_same_bits

WIRES = [torch.float32, torch.float16, torch.bfloat16]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def layouts(draw):
    """(N, C): N from 0 to a few thousand, C from 1 to larger than N (N < C, partial chunks)."""
    n = draw(st.integers(0, 3000))
    c = draw(st.sampled_from([1, 2, 3, 7, 16, 64, 100, 256, 1024, 5000]))
    return n, c


def _vec(seed: int, n: int, scale: float = 1.0, specials: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * scale
    if specials and n:
        # wide magnitudes: values that overflow, underflow and land in half's subnormals
        e = torch.randint(-30, 20, (n,), generator=g).float()
        x = x * torch.pow(2.0, e)
    return x


@st.composite
def chosen(draw, nch):
    """k in {0, 1, random, nchunks} chunks, sorted indices."""
    k = draw(st.sampled_from([0, 1, nch, max(0, nch // 3)]))
    k = min(k, nch)
    perm = torch.randperm(nch, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**16))))
    return torch.sort(perm[:k]).values


@SETTINGS
@given(lay=layouts(), norm=st.sampled_from(["l1", "l2"]), has_r=st.booleans(),
       mom=st.sampled_from([None, "plain", "nesterov"]), alias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_chunk_norms_matches_reference(lay, norm, has_r, mom, alias, seed):
    n, c = lay
    grad = _vec(seed, n)
    res = _vec(seed + 1, n) if has_r else None
    momentum = _vec(seed + 2, n) if mom else None
    outs = {}
    for impl in ("numba", "torch"):
        g = grad.clone()
        m_in = momentum.clone() if mom else None
        m_out = (m_in if alias else torch.empty(n)) if mom else None
        r = res.clone() if has_r else None
        norms = K.chunk_norms(g, r, c, norm, momentum=m_in, momentum_out=m_out, m=0.9,
                              nesterov=mom == "nesterov", impl=impl)
        if has_r:
            assert torch.equal(r, res), "chunk_norms must not modify the residual"
        outs[impl] = (g, m_out, norms)
    assert outs["numba"][2].shape == (math.ceil(n / c),)
    assert_same_bits(outs["numba"][0], outs["torch"][0])
    if mom:
        assert_same_bits(outs["numba"][1], outs["torch"][1])
    torch.testing.assert_close(outs["numba"][2], outs["torch"][2], rtol=2e-5, atol=1e-5)


@SETTINGS
@given(lay=layouts(), norm=st.sampled_from(["l1", "l2"]), has_r=st.booleans(),
       mom=st.sampled_from([None, "plain", "nesterov"]), zero=st.booleans(),
       into_r=st.booleans(), seed=st.integers(0, 2**16))
def test_chunk_norms_into_v_out_matches_reference(lay, norm, has_r, mom, zero, into_r, seed):
    """v written into a buffer of its own, or over the residual it reads (the in-place state of
    the FSDP2 path), with grad zeroed or left, is the in-place v, bit for bit."""
    n, c = lay
    grad = _vec(seed, n)
    res = _vec(seed + 1, n) if has_r else None
    momentum = _vec(seed + 2, n) if mom else None
    kw = dict(m=0.9, nesterov=mom == "nesterov")
    in_place = grad.clone()
    m_ref = torch.empty(n) if mom else None
    norms_ref = K.chunk_norms(in_place, res, c, norm, momentum=momentum, momentum_out=m_ref,
                              impl="torch", **kw)
    for impl in ("numba", "torch"):
        g = grad.clone()
        r = res.clone() if has_r else None
        v = r if into_r and has_r else torch.full((n,), 5.0)
        m_out = torch.empty(n) if mom else None
        norms = K.chunk_norms(g, r, c, norm, momentum=momentum, momentum_out=m_out,
                              v_out=v, zero_grad=zero, impl=impl, **kw)
        assert_same_bits(v, in_place)
        assert_same_bits(g, torch.zeros(n) if zero else grad)
        if mom:
            assert_same_bits(m_out, m_ref)
        torch.testing.assert_close(norms, norms_ref, rtol=2e-5, atol=1e-5)


def test_chunk_norms_refuses_an_aliased_v_out_and_zero_grad_alone():
    g, r, mom = torch.ones(8), torch.ones(8), torch.ones(8)
    with pytest.raises(ValueError, match="v_out must not be grad or momentum"):
        K.chunk_norms(g, r, 4, v_out=g)
    with pytest.raises(ValueError, match="v_out must not be grad or momentum"):
        K.chunk_norms(g, r, 4, momentum=mom, momentum_out=mom, v_out=mom)
    with pytest.raises(ValueError, match="zero_grad=True needs a v_out"):
        K.chunk_norms(g, r, 4, zero_grad=True)


def test_chunk_norms_propagates_non_finite():
    g = torch.ones(10)
    g[3] = float("nan")
    g[7] = float("inf")
    n = K.chunk_norms(g, torch.zeros(10), 4, impl="numba")
    assert math.isnan(n[0]) and math.isinf(n[1]) and n[2] == 2.0


@SETTINGS
@given(lay=layouts(), wire=st.sampled_from(WIRES), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1.0, 0.5, 1 / 3, 1 / 7, 1024.0]), data=st.data())
def test_pack_matches_reference(lay, wire, seed, scale, data):
    n, c = lay
    v = _vec(seed, n, 100.0, specials=True)
    idx = data.draw(chosen(R.nchunks_of(n, c)))
    ours = K.pack_chunks(v, idx, c, scale, wire, impl="numba")
    ref = K.pack_chunks(v, idx, c, scale, wire, impl="torch")
    assert ours.dtype == wire and ours.numel() == idx.numel() * c
    assert_same_bits(ours, ref)
    # into a given out buffer, as the caller's reusable send buffer
    out = torch.full((idx.numel() * c,), 7.0, dtype=wire)
    assert K.pack_chunks(v, idx, c, scale, wire, out=out, impl="numba") is out
    assert_same_bits(out, ref)


@SETTINGS
@given(lay=layouts(), wire=st.sampled_from(WIRES), seed=st.integers(0, 2**16),
       has_r=st.booleans(), has_loc=st.booleans(), alias=st.booleans(), data=st.data())
def test_unpack_update_matches_reference(lay, wire, seed, has_r, has_loc, alias, data):
    n, c = lay
    v = _vec(seed, n, 10.0)
    idx = data.draw(chosen(R.nchunks_of(n, c)))
    local = K.pack_chunks(v, idx, c, 0.5, wire, impl="torch")
    reduced = (local.float() * 2).to(wire)  # as if two ranks had sent the same
    results = {}
    for impl in ("numba", "torch"):
        vv = v.clone()
        r = torch.full((n,), 9.0) if has_r else None
        out = vv if alias else torch.full((n,), 9.0)
        got = K.unpack_update(vv, r, reduced, local if has_loc else None, idx, c, 0.5, 2.0,
                              out=out, impl=impl)
        assert got is out
        results[impl] = (out, r)
    assert_same_bits(results["numba"][0], results["torch"][0])
    if has_r:
        assert_same_bits(results["numba"][1], results["torch"][1])


@SETTINGS
@given(lay=layouts(), wire=st.sampled_from(WIRES), seed=st.integers(0, 2**16),
       has_r=st.booleans(), has_loc=st.booleans(), data=st.data())
def test_unpack_sent_matches_reference_and_unpack_update(lay, wire, seed, has_r, has_loc, data):
    """norms into v_out + zero_grad, then unpack_sent == unpack_update on the same v, bitwise."""
    n, c = lay
    v = _vec(seed, n, 10.0, specials=True)
    idx = data.draw(chosen(R.nchunks_of(n, c)))
    local = K.pack_chunks(v, idx, c, 0.5, wire, impl="torch")
    reduced = (local.float() * 2).to(wire)  # as if two ranks had sent the same
    loc = local if has_loc else None
    # The full pass: out over v, residual from v.
    full_out, full_r = v.clone(), (torch.full((n,), 9.0) if has_r else None)
    K.unpack_update(full_out, full_r, reduced, loc, idx, c, 0.5, 2.0, out=full_out, impl="torch")
    for impl in ("numba", "torch"):
        out = torch.zeros(n)  # what chunk_norms(..., zero_grad=True) leaves in the gradient
        r = v.clone() if has_r else None  # ... and v, in the spare residual
        assert K.unpack_sent(out, r, reduced, loc, idx, c, 0.5, 2.0, impl=impl) is out
        assert_same_bits(out, full_out)
        if has_r:
            assert_same_bits(r, full_r)


def test_unpack_sent_refuses_unsorted_or_repeated_chunks():
    out, r = torch.zeros(8), torch.zeros(8)
    p = torch.zeros(8, dtype=torch.float16)
    with pytest.raises(ValueError, match="strictly increasing"):
        K.unpack_sent(out, r, p, p, torch.tensor([1, 1]), 4, 1.0, 1.0, impl="numba")


@SETTINGS
@given(lay=layouts(), norm=st.sampled_from(["l1", "l2"]), seed=st.integers(0, 2**16),
       data=st.data())
def test_masked_chunk_norms_matches_reference(lay, norm, seed, data):
    n, c = lay
    nch = R.nchunks_of(n, c)
    v = _vec(seed, n)
    chunks = data.draw(chosen(nch))
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(chunks.numel(), c, generator=g) < 0.6
    got = {}
    for impl in ("numba", "torch"):
        out = torch.full((nch,), 5.0)
        assert K.masked_chunk_norms(v, chunks, keep, c, norm, out=out, impl=impl) is out
        got[impl] = out
    untouched = torch.ones(nch, dtype=torch.bool)
    untouched[chunks] = False
    assert bool((got["numba"][untouched] == 5.0).all())
    torch.testing.assert_close(got["numba"], got["torch"], rtol=2e-5, atol=1e-5)
    # keep all: exactly chunk_norms' bits for those chunks (one definition of a chunk's norm)
    full = K.masked_chunk_norms(v, chunks, torch.ones(chunks.numel(), c, dtype=torch.bool), c, norm,
                                out=torch.zeros(nch), impl="numba")
    plain = K.chunk_norms(v.clone(), None, c, norm, impl="numba")
    assert_same_bits(full[chunks], plain[chunks])


@SETTINGS
@given(n=st.integers(1, 3000), wire=st.sampled_from(WIRES), seed=st.integers(0, 2**16),
       has_r=st.booleans(), data=st.data())
def test_dense_scatter_matches_reference(n, wire, seed, has_r, data):
    d = data.draw(st.integers(0, n))
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:d]
    v = _vec(seed, d, 100.0, specials=True)
    local = K.cast_scaled(v, 0.5, wire, impl="torch")
    reduced = (local.float() * 2).to(wire)
    got = {}
    for impl in ("numba", "torch"):
        out, r = torch.full((n,), 3.0), (torch.full((n,), 4.0) if has_r else None)
        assert K.dense_scatter(out, r, idx, reduced, local, v, 0.5, 2.0, impl=impl) is out
        got[impl] = (out, r)
    assert_same_bits(got["numba"][0], got["torch"][0])
    if has_r:
        assert_same_bits(got["numba"][1], got["torch"][1])


@SETTINGS
@given(n=st.integers(0, 3000), wire=st.sampled_from(WIRES), seed=st.integers(0, 2**16),
       bad=st.sampled_from([None, "inf", "-inf", "nan"]), data=st.data())
def test_all_finite_matches_reference(n, wire, seed, bad, data):
    x = _vec(seed, n, 100.0, specials=True).to(wire)  # specials: some overflow to inf in 16 bits
    if bad is not None and n:
        x[data.draw(st.integers(0, n - 1))] = float(bad)
    want = bool(torch.isfinite(x).all())
    assert K.all_finite(x, impl="numba") is K.all_finite(x, impl="torch") is want


@SETTINGS
@given(n=st.integers(0, 5000), wire=st.sampled_from(WIRES), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1.0, 0.25, 1 / 3]))
def test_dense_cast_and_upcast_match_reference(n, wire, seed, scale):
    x = _vec(seed, n, 1000.0, specials=True)
    ours = K.cast_scaled(x, scale, wire, impl="numba")
    assert_same_bits(ours, K.cast_scaled(x, scale, wire, impl="torch"))
    up = K.upcast_scaled(ours, 1 / scale, out=torch.empty(n), impl="numba")
    assert_same_bits(up, K.upcast_scaled(ours, 1 / scale, out=torch.empty(n), impl="torch"))


@pytest.mark.parametrize("wire", WIRES)
def test_csc_round_trip_loses_nothing(wire):
    """Error feedback invariant on one rank: applied + new residual == gradient + old residual."""
    n, c = 10_007, 64
    grad, res = _vec(1, n), _vec(2, n) * 0.1
    expected = (grad.double() + res.double())
    norms = K.chunk_norms(grad, res, c)
    idx = K.select_chunks(norms, 20)
    packed = K.pack_chunks(grad, idx, c, 1.0, wire)
    local = packed.clone()
    K.unpack_update(grad, res, packed, local, idx, c, 1.0, 1.0, out=grad)
    torch.testing.assert_close(grad.double() + res.double(), expected, rtol=0, atol=1e-6)
    assert int((grad != 0).sum()) <= 20 * c


@SETTINGS
@given(n=st.integers(0, 40000), wire=st.sampled_from(WIRES), seed=st.integers(0, 2**16),
       has_r=st.booleans(), has_r_out=st.booleans(), specials=st.booleans(),
       world=st.sampled_from([1, 2, 3, 4, 8]))
def test_cast_feedback_matches_reference(n, wire, seed, has_r, has_r_out, specials, world):
    # n up to past two of the kernel's 16 K blocks, so partial blocks are covered too.
    x = _vec(seed, n, 1000.0, specials=specials)
    res = _vec(seed + 1, n, 10.0, specials=specials) if has_r else None
    got = {}
    for impl in ("numba", "torch"):
        r_out = torch.full((n,), 7.0) if has_r_out else None
        out = torch.full((n,), 3.0).to(wire)
        assert K.cast_feedback(x, res, 1.0 / world, wire, float(world), out=out, residual_out=r_out,
                               impl=impl) is out
        got[impl] = (out, r_out)
    assert_same_bits(got["numba"][0], got["torch"][0])
    if has_r_out:
        assert_same_bits(got["numba"][1], got["torch"][1])


def test_cast_feedback_keeps_what_the_wire_rounds_away():
    """residual_out + upcast(out) * n == x + residual (exactly, for in-range values)."""
    x, r = _vec(3, 10_000), _vec(4, 10_000) * 0.01
    out, r_out = torch.empty(10_000, dtype=torch.float16), torch.empty(10_000)
    K.cast_feedback(x, r, 0.5, torch.float16, 2.0, out=out, residual_out=r_out)
    torch.testing.assert_close(r_out.double() + out.double() * 2, x.double() + r.double(),
                               rtol=0, atol=1e-6)
    # the residual may be updated in place
    r2 = r.clone()
    K.cast_feedback(x, r2, 0.5, torch.float16, 2.0, out=out, residual_out=r2)
    assert_same_bits(r2, r_out)


@SETTINGS
@given(n=st.integers(0, 40000), wire=st.sampled_from(WIRES), seed=st.integers(0, 2**16),
       bad=st.sampled_from([None, "inf", "-inf", "nan"]), scale=st.sampled_from([1.0, 0.5, 3.0]),
       data=st.data())
def test_upcast_finite_matches_reference(n, wire, seed, bad, scale, data):
    x = _vec(seed, n, 100.0).to(wire)
    if bad is not None and n:
        x[data.draw(st.integers(0, n - 1))] = float(bad)
    outs = {}
    for impl in ("numba", "torch"):
        out = torch.full((n,), 5.0)
        outs[impl] = (K.upcast_finite(x, scale, out=out, impl=impl), out)
    assert outs["numba"][0] is outs["torch"][0] is (bad is None or n == 0)
    assert_same_bits(outs["numba"][1], outs["torch"][1])


def test_upcast_finite_sees_overflow_of_the_scale():
    x = torch.full((5,), 60000.0, dtype=torch.float16)
    assert K.upcast_finite(x, 1.0, out=torch.empty(5))
    assert not K.upcast_finite(x, 1e36, out=torch.empty(5))
