"""select_chunks: top-k by norm, deterministic ties, NaN as +inf, forced chunks."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradientflow import kernels as K

norm_values = (st.sampled_from([0.0, 1.0, 2.0, 2.0, 3.5, float("inf"), float("nan")])
               | st.floats(0, 10, width=32))


@settings(max_examples=200, deadline=None)
@given(norms=st.lists(norm_values, min_size=0, max_size=60), data=st.data())
def test_top_k_with_lower_index_tie_break(norms, data):
    t = torch.tensor(norms, dtype=torch.float32)
    k = data.draw(st.integers(0, len(norms)))
    idx = K.select_chunks(t, k)
    assert idx.dtype == torch.int64 and idx.numel() == k
    assert torch.equal(idx, torch.sort(idx).values)
    # the brute-force definition: order by (-key, index), NaN -> +inf
    key = [math.inf if math.isnan(x) else x for x in norms]
    expect = sorted(sorted(range(len(norms)), key=lambda i: (-key[i], i))[:k])
    assert idx.tolist() == expect


@settings(max_examples=100, deadline=None)
@given(norms=st.lists(norm_values, min_size=1, max_size=40), data=st.data())
def test_forced_chunks_are_added_and_not_counted(norms, data):
    n = len(norms)
    t = torch.tensor(norms, dtype=torch.float32)
    forced = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    k = data.draw(st.integers(0, n))
    idx = K.select_chunks(t, k, forced=forced)
    free = int((~forced).sum())
    assert idx.numel() == min(k, free) + int(forced.sum())
    assert set(torch.nonzero(forced).flatten().tolist()) <= set(idx.tolist())
    assert torch.equal(idx, torch.sort(idx).values)
    key = [math.inf if math.isnan(x) else x for x in norms]
    unforced = [i for i in range(n) if not forced[i]]
    top = sorted(unforced, key=lambda i: (-key[i], i))[: min(k, free)]
    assert sorted(top + torch.nonzero(forced).flatten().tolist()) == idx.tolist()


@settings(max_examples=200, deadline=None)
@given(norms=st.lists(norm_values | st.sampled_from([-0.0, -1.0, float("-inf")]), min_size=0,
                      max_size=300),
       data=st.data())
def test_numba_selection_equals_the_reference(norms, data):
    """The O(n) partition kernel picks exactly what the stable sort picks, ties and NaN included."""
    t = torch.tensor(norms, dtype=torch.float32)
    k = data.draw(st.integers(0, len(norms)))
    assert torch.equal(K.select_chunks(t, k, impl="numba"), K.select_chunks(t, k, impl="torch"))


def test_invalid_k_is_refused():
    with pytest.raises(ValueError, match="k must be"):
        K.select_chunks(torch.ones(3), 4)
    with pytest.raises(ValueError, match="forced must be"):
        K.select_chunks(torch.ones(3), 1, forced=torch.ones(2, dtype=torch.bool))
