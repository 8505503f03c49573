"""cross_rank: the ranks' agreement on a description, over a fake exchange and a real store."""
from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from gradientflow.cross_rank import (DIGEST_WORDS, StoreExchange, agree, digest_words,
                                     disagreement)


class Lockstep:
    """The exchange of `n` ranks run by threads, each rank's method returning every rank's value."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=30)
        self.slots: list = [None] * n
        self.calls = {"digests": 0, "descriptions": 0}

    def of(self, rank: int):
        pool = self

        class One:
            def _gather(self, value):
                pool.slots[rank] = value
                pool.barrier.wait()
                out = list(pool.slots)
                pool.barrier.wait()
                return out

            def digests(self, words):
                pool.calls["digests"] += rank == 0
                return self._gather(words)

            def descriptions(self, description):
                pool.calls["descriptions"] += rank == 0
                return self._gather(description)

        return One()


def run_ranks(descriptions: list[str], exchange_of) -> list:
    out: list = [None] * len(descriptions)

    def one(r):
        out[r] = agree(descriptions[r], exchange_of(r), r)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(descriptions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank did not return"
    return out


def test_digest_is_fixed_size_and_tells_descriptions_apart():
    a, b = digest_words("x" * 10_000), digest_words("x" * 9_999 + "y")
    assert len(a) == len(b) == DIGEST_WORDS and a != b
    assert digest_words("same") == digest_words("same")


def test_agreeing_ranks_exchange_only_the_digest():
    ex = Lockstep(3)
    assert run_ranks(["plan A"] * 3, ex.of) == [None, None, None]
    assert ex.calls == {"digests": 1, "descriptions": 0}


def test_a_mismatch_names_every_rank_on_every_rank():
    ex = Lockstep(3)
    found = run_ranks(["plan A", "plan B", "plan A"], ex.of)
    assert ex.calls == {"digests": 1, "descriptions": 1}
    for r, f in enumerate(found):
        assert f is not None and f.rank == r
        assert f.sentence() == "ranks 0, 2: plan A; rank 1: plan B"
        assert f.descriptions[f.other()] != f.descriptions[r]


def test_disagreement_alone():
    assert disagreement(["a", "a"], 0) is None
    d = disagreement(["a", "b"], 1)
    assert d is not None and d.ranks_holding() == {"a": [0], "b": [1]} and d.other() == 0


@pytest.mark.parametrize("views", [["s1", "s1", "s1"], ["s1", "s2", "s1"]])
def test_store_exchange_through_rank_0(views):
    store = dist.HashStore()
    found = run_ranks(views, lambda r: StoreExchange(store, "t/", r, len(views), 30.0))
    if len(set(views)) == 1:
        assert found == [None] * len(views)
    else:
        assert all(f is not None and f.descriptions == tuple(views) for f in found)
