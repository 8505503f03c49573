"""Selection over the pool: equal to its torch reference, and independent of the bucketing."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from compression_helpers import SETTINGS
from gradientflow.compression.selection import (bucket_quota, pool_quota, select_pool,
                                                select_pool_reference)

# Norms on a coarse grid, so ties are frequent and the tie-break is exercised.
norm_lists = st.lists(st.lists(st.integers(0, 6).map(float), min_size=0, max_size=40),
                      min_size=1, max_size=5)
densities = st.sampled_from([0.01, 0.1, 0.3, 1.0])


def _tensors(lists):
    return [torch.tensor(v, dtype=torch.float32) for v in lists]


@SETTINGS
@given(lists=norm_lists, density=densities, quota=st.sampled_from(["pool", "bucket"]),
       data=st.data())
def test_select_pool_equals_the_reference(lists, density, quota, data):
    norms = _tensors(lists)
    eligible = data.draw(st.lists(st.booleans(), min_size=len(norms), max_size=len(norms)))
    got = select_pool(norms, density, quota=quota, eligible=eligible)
    ref = select_pool_reference(norms, density, quota=quota, eligible=eligible)
    assert [g.tolist() for g in got] == [r.tolist() for r in ref]
    sizes = [n.numel() for n, e in zip(norms, eligible) if e]
    total = sum(len(g) for g in got)
    if quota == "pool":
        # every bucket's chunks count towards the quota; only eligible ones can be chosen
        quota_all = pool_quota([n.numel() for n in norms], density)
        assert total == min(sum(sizes), quota_all) if sizes else total == 0
    else:
        assert total == sum(bucket_quota(n, density) for n in sizes)
    assert all(len(g) == 0 for g, e in zip(got, eligible) if not e)


@SETTINGS
@given(values=st.lists(st.integers(0, 9).map(float), min_size=1, max_size=120), density=densities,
       cuts_a=st.lists(st.integers(1, 119), max_size=5),
       cuts_b=st.lists(st.integers(1, 119), max_size=5))
def test_pool_selection_does_not_depend_on_the_bucketing(values, density, cuts_a, cuts_b):
    """The same chunks cut into buckets two ways: the pool picks the same global chunks."""
    flat = torch.tensor(values, dtype=torch.float32)

    def picked(cuts):
        edges = [0, *sorted({c for c in cuts if c < len(values)}), len(values)]
        buckets = [flat[s:e] for s, e in zip(edges, edges[1:])]
        out = select_pool(buckets, density, quota="pool")
        return sorted(int(i) + s for idx, s in zip(out, edges) for i in idx)

    assert picked(cuts_a) == picked(cuts_b) == select_pool([flat], density)[0].tolist()


def test_nan_ranks_first_and_bad_arguments_are_refused():
    norms = [torch.tensor([1.0, 2.0]), torch.tensor([float("nan"), 0.5])]
    assert [x.tolist() for x in select_pool(norms, 0.25)] == [[], [0]]
    with pytest.raises(ValueError, match="quota='global'"):
        select_pool(norms, 0.1, quota="global")
    with pytest.raises(ValueError, match="one per bucket"):
        select_pool(norms, 0.1, eligible=[True])
    with pytest.raises(ValueError, match=r"density=0 must be in \(0, 1\]"):
        select_pool(norms, 0)
