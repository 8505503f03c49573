"""StepGraphs on CUDA tensors: the captured step replays the eager step's results, bit for bit,
on new contents in the same buffers; a step that cannot be captured runs eagerly. Skipped
without a GPU (tests/gpu/conftest.py); tests/kernels/test_graphs.py covers the CPU fallback.
"""
from __future__ import annotations

import pytest
import torch
from bits import assert_same_bits
from hypothesis import given, settings
from hypothesis import strategies as st

from gradientflow import kernels as K

DEV = "cuda"
N, C = 300_000, 1024
NCH = K.nchunks_of(N, C)


def _csc_step(g, r, spare, send, k, momentum, mom_out):
    kw = dict(momentum=momentum, momentum_out=mom_out, m=0.9) if momentum is not None else {}
    norms = K.chunk_norms(g, r, C, "l1", v_out=spare, zero_grad=True, **kw)
    idx = K.select_chunks(norms, k)
    packed = K.pack_chunks(spare, idx, C, 0.5, torch.float16, out=send)
    local = packed.clone()
    K.unpack_sent(g, spare, packed, local, idx, C, 2.0, 2.0)
    return norms, idx, local


_STEP = K.StepGraphs(_csc_step)  # one for all examples: later examples replay its graphs
_BUF = {}


def _buffers(k):
    if k not in _BUF:
        _BUF[k] = [torch.empty(N, device=DEV) for _ in range(5)] + [
            torch.empty(k * C, dtype=torch.float16, device=DEV)]
    return _BUF[k]


@settings(max_examples=12, deadline=None)
@given(k=st.sampled_from([1, 3, 29]), momentum=st.booleans(), seed=st.integers(0, 2**16),
       nan=st.booleans())
def test_replay_equals_eager_on_new_contents(k, momentum, seed, nan):
    gen = torch.Generator().manual_seed(seed)
    g0, r0, m0 = (torch.randn(N, generator=gen).to(DEV) for _ in range(3))
    if nan:
        g0[int(torch.randint(0, N, (1,), generator=gen))] = float("nan")
    g, r, spare, mom, mom_out, send = _buffers(k)
    # the eager step on copies (the reference of a replay is the step itself)
    ge, se, mo_e = g0.clone(), torch.empty(N, device=DEV), torch.empty(N, device=DEV)
    send_e = torch.empty_like(send)
    ref = _csc_step(ge, r0, se, send_e, k, m0 if momentum else None, mo_e if momentum else None)
    for _ in range(3):  # the first calls of a layout warm and capture; a replay after
        g.copy_(g0)
        r.copy_(r0)
        mom.copy_(m0)
        got = _STEP(g, r, spare, send, k, mom if momentum else None,
                    mom_out if momentum else None)
        for a, b in zip(got, ref):
            if a.is_floating_point():
                assert_same_bits(a, b)
            else:
                assert torch.equal(a, b)
        assert_same_bits(g, ge)
        assert_same_bits(spare, se)
        assert_same_bits(send, send_e)
        if momentum:
            assert_same_bits(mom_out, mo_e)
    assert _STEP.counts["replayed"] > 0 and _STEP.counts["failed"] == 0


def test_a_host_sync_falls_back_to_eager():
    def syncing(x, out):
        out.copy_(x * (2.0 if x.sum().item() > 0 else 3.0))
        return out

    step = K.StepGraphs(syncing)
    x, out = torch.ones(10, device=DEV), torch.empty(10, device=DEV)
    step(x, out)
    with pytest.warns(RuntimeWarning, match="cannot be captured"):
        step(x, out)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    x.fill_(-1.0)
    assert torch.equal(step(x, out), torch.full((10,), -3.0, device=DEV))
    assert step.counts == {"eager": 3, "captured": 0, "replayed": 0, "failed": 1}


def test_layouts_beyond_max_graphs_are_recaptured():
    step = K.StepGraphs(lambda x, out: torch.mul(x, 2.0, out=out), max_graphs=1)
    xs = [torch.arange(8, device=DEV, dtype=torch.float32) + i for i in range(2)]
    outs = [torch.empty(8, device=DEV) for _ in range(2)]
    for rep in range(4):
        for x, out in zip(xs, outs):
            x.add_(1.0)
            assert torch.equal(step(x, out), x * 2)
    assert len([e for e in step._graphs.values() if isinstance(e, tuple)]) == 1


def test_inside_a_capture_runs_eagerly_into_it():
    step = K.StepGraphs(lambda x, out: torch.mul(x, 2.0, out=out))
    x, out = torch.ones(4, device=DEV), torch.empty(4, device=DEV)
    step(x, out)  # warm: the next call would capture
    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        step(x, out)
    x.fill_(5.0)
    outer.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full((4,), 10.0, device=DEV))
    assert step.counts["captured"] == 0
