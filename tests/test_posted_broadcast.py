"""The root of an asynchronous carried broadcast does not wait for the other rank.

gloo's root sends and returns; a round that is an exchange would hold it until the other rank
reaches the broadcast (DDP's buffers, before every forward). The root posts its frame and reads
the other rank's words at its next round (rounds.py): the broadcast still gives gloo's bits, a
mismatch is still found on every rank (the root's at its next call, naming the broadcast), and
nothing hangs, also when the group closes with the round unread.
"""
from __future__ import annotations

import pytest

N = 2420  # 9.6 KB of float32: above the 4 KiB in-band room, as DDP's ResNet buffers are


def root_returns_first(rank, world):
    """Rank body: rank 0's async broadcast returns complete before rank 1 has issued its
    own (rank 1 issues it only once rank 0 says so through the store); rank 1 then gets rank
    0's tensor, for a broadcast in the in-band room and for one in a kept room."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    from gradientflow.backend import backend_of

    store = _get_default_store()
    stats = backend_of().engine.stats
    for n in (N, N):  # two alike broadcasts keep room for the size (rounds.py)
        y = torch.full((n,), float(rank))
        dist.broadcast(y, src=0)
    for i, n in enumerate((256, N, N)):
        x = torch.arange(n, dtype=torch.float32) + 10 * i
        mine = x if rank == 0 else torch.zeros(n)
        before = stats.bcast_carried
        key = f"root-returned-{i}"
        if rank == 0:
            work = dist.broadcast(mine, src=0, async_op=True)
            assert work.get_future().done(), f"rank 0: broadcast {i} not complete at once"
            work.wait()
            store.set(key, "1")
        else:
            try:
                store.wait([key], datetime.timedelta(seconds=20))
            except Exception as exc:  # noqa: BLE001 - named below
                raise AssertionError(f"rank 1: rank 0's broadcast {i} ({n} elements) did not "
                                     f"return before rank 1 issued its own: {exc}") from None
            dist.broadcast(mine, src=0, async_op=True).wait()
        assert torch.equal(mine, x), f"rank {rank}: broadcast {i} differs from the root's"
        assert stats.bcast_carried - before == 1, f"rank {rank}: broadcast {i} not carried"
    z = torch.full((5,), float(rank + 1))
    dist.all_reduce(z)  # the root's next round reads the last posted one
    assert torch.equal(z, torch.full((5,), 3.0)), f"rank {rank}: wrong sum after"
    return True


def test_the_root_of_an_async_broadcast_does_not_wait(pools):
    assert pools(2).run(root_returns_first, timeout=90, pg_timeout_s=30) == [True, True]


def posted_mismatch_named(rank, world, case):
    """Rank body: after two alike broadcasts, an async broadcast that the ranks issue
    differently (another size, another root, an allreduce against it): every rank gets an
    error naming the call's sequence number, the root at its next collective at the latest;
    a rank's own tensor is untouched; nothing hangs (the group closes after)."""
    import torch
    import torch.distributed as dist

    for _ in range(2):
        y = torch.full((N,), float(rank))
        dist.broadcast(y, src=0)
    x = torch.full((N + (24 * rank if case == "size" else 0),), float(rank + 5))
    if case == "root":
        call = lambda: dist.broadcast(x, src=rank, async_op=True).wait()  # noqa: E731
    elif case == "op":
        call = ((lambda: dist.broadcast(x, src=0, async_op=True).wait()) if rank == 0
                else (lambda: dist.all_reduce(x)))
    else:
        call = lambda: dist.broadcast(x, src=0, async_op=True).wait()  # noqa: E731
    errors = []
    for step in (call, lambda: dist.all_reduce(torch.ones(3))):
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - inspected below
            errors.append(str(exc))
            break
    assert errors, f"rank {rank}: no error for a broadcast the ranks issued differently"
    assert f"rank {rank}" in errors[0] and "sequence number 2" in errors[0], (rank, errors)
    assert "mismatch" in errors[0], (rank, errors)
    assert torch.equal(x, torch.full_like(x, float(rank + 5))), (
        f"rank {rank}: a mismatched call changed its tensor")
    return errors[0]


@pytest.mark.parametrize("case", ["root", "size", "op"])
def test_a_mismatch_in_a_posted_round_is_named_on_every_rank(pools, case):
    pools(2).run(posted_mismatch_named, case, timeout=120, pg_timeout_s=20)


def closes_with_a_posted_round(rank, world):
    """Rank body: the last collective is an async broadcast its root does not wait for; the
    group is destroyed right after on both ranks, without a hang."""
    import torch
    import torch.distributed as dist

    for _ in range(3):
        y = torch.full((N,), float(rank))
        dist.broadcast(y, src=0, async_op=True).wait()
        assert torch.equal(y, torch.zeros(N)), f"rank {rank}: wrong broadcast"
    return True


def test_a_group_closes_with_a_posted_round(pools):
    assert pools(2).run(closes_with_a_posted_round, timeout=60, pg_timeout_s=20) == [True,
                                                                                       True]
