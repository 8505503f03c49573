"""The agreement rounds' words, as pure functions: the fused engine's two MIN words
(engine.round_words / read_round).

Every rank contributes round_words(k, fingerprint); the transport MIN-reduces them element by
element. What the engine reads back must be the smallest and largest k over the ranks and, when
every rank has the same k, the smallest and largest fingerprint: the round's whole check.
"""
from __future__ import annotations


from hypothesis import given, settings
from hypothesis import strategies as st

from gradientflow.engine.agreement import _FP_MASK, MAX_BATCH, read_round, round_words

ranks = st.lists(st.tuples(st.integers(1, MAX_BATCH), st.integers(0, 2**61 - 1)),
                 min_size=1, max_size=8)


def _allreduce_min(per_rank):
    words = [round_words(k, f) for k, f in per_rank]
    return [min(w[i] for w in words) for i in range(2)]


@settings(max_examples=500, deadline=None)
@given(per_rank=ranks)
def test_round_reads_the_smallest_and_largest_candidate_count(per_rank):
    n, n_max, lo, hi = read_round(*_allreduce_min(per_rank))
    assert n == min(k for k, _ in per_rank)
    assert n_max == max(k for k, _ in per_rank)
    assert all(0 <= w < 2**63 for w in round_words(*per_rank[0]))  # fits a signed int64
    fps = [f & _FP_MASK for k, f in per_rank if k == n]
    assert lo == min(fps)
    assert hi == max(f & _FP_MASK for k, f in per_rank if k == n_max)


@settings(max_examples=300, deadline=None)
@given(k=st.integers(1, MAX_BATCH), fps=st.lists(st.integers(0, 2**61 - 1), min_size=1,
                                                  max_size=8))
def test_same_count_agrees_exactly_when_every_fingerprint_matches(k, fps):
    n, n_max, lo, hi = read_round(*_allreduce_min([(k, f) for f in fps]))
    assert n == n_max == k
    assert (lo == hi) == (len({f & _FP_MASK for f in fps}) == 1)
