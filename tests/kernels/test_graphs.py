"""StepGraphs without a GPU: every call runs the step eagerly, with the step's own results.

The capture and the replays are tested on CUDA tensors in tests/gpu/test_graphs.py.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradientflow import kernels as K
from gradientflow.kernels.graphs import _layout


def _csc_step(g, r, spare, send, k, chunk):
    norms = K.chunk_norms(g, r, chunk, "l1", v_out=spare, zero_grad=True)
    idx = K.select_chunks(norms, k)
    packed = K.pack_chunks(spare, idx, chunk, 0.5, torch.float16, out=send)
    K.unpack_sent(g, spare, packed, packed.clone(), idx, chunk, 2.0, 2.0)
    return norms, idx


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 3000), chunk=st.sampled_from([1, 16, 100, 1024]), data=st.data(),
       seed=st.integers(0, 2**16))
def test_cpu_tensors_run_eagerly_every_call(n, chunk, data, seed):
    """On CPU tensors the wrapped step is the step: same results, call after call."""
    nch = K.nchunks_of(n, chunk)
    k = data.draw(st.integers(0, nch))
    step = K.StepGraphs(_csc_step)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(3):  # the calls that would warm, capture and replay on a GPU
        g, r = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        g2, r2 = g.clone(), r.clone()
        spare, spare2 = torch.empty(n), torch.empty(n)
        send, send2 = (torch.empty(k * chunk, dtype=torch.float16) for _ in range(2))
        norms, idx = step(g, r, spare, send, k, chunk)
        norms2, idx2 = _csc_step(g2, r2, spare2, send2, k, chunk)
        assert torch.equal(idx, idx2) and torch.equal(norms, norms2)
        assert torch.equal(g, g2) and torch.equal(spare, spare2) and torch.equal(send, send2)
    assert step.counts == {"eager": 3, "captured": 0, "replayed": 0, "failed": 0}


def test_layout_key():
    """No key (eager) without a CUDA tensor or with an argument that cannot be one."""
    x = torch.ones(3)
    assert _layout((x, 2), {}) == (None, None)
    assert _layout((1, 2.0, "l1", None, torch.float16), {}) == (None, None)
    assert _layout((x,), {"out": [x]}) == (None, None)


def test_arguments_refused():
    with pytest.raises(TypeError, match="fn must be callable"):
        K.StepGraphs(3)
    with pytest.raises(ValueError, match="max_graphs must be an int >= 1"):
        K.StepGraphs(_csc_step, max_graphs=0)


def test_kept_layouts_stay_bounded():
    """Graphs beyond max_graphs and failed layouts beyond 4 x max_graphs are forgotten, oldest
    first; the newest of each kind stay."""
    from gradientflow.kernels.graphs import _EAGER
    step = K.StepGraphs(_csc_step, max_graphs=2)
    for i in range(5):
        step._store(("graph", i), ("g", i))
    for i in range(12):
        step._store(("failed", i), _EAGER)
    kept = list(step._graphs)
    assert [k for k in kept if k[0] == "graph"] == [("graph", 3), ("graph", 4)]
    assert [k for k in kept if k[0] == "failed"] == [("failed", i) for i in range(4, 12)]
