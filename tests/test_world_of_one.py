"""A gradientflow group of one rank: every route works, the solo channel's included.

With one rank the backend makes no side group for the solo channel's check rounds (there is no
other rank to pair with); they run on the solo transport itself.
"""
from __future__ import annotations


def solo_sized_allreduces(rank, world):
    import torch
    import torch.distributed as dist

    x = torch.arange(2_000_000, dtype=torch.float32)  # 8 MB: at least the solo threshold
    y = x.clone()
    dist.all_reduce(y)
    dist.all_reduce(y, async_op=True).wait()
    small = torch.ones(4)
    dist.all_reduce(small)  # deferred, agreed by a round of one
    return bool(torch.equal(x, y)) and small.tolist() == [1.0] * 4


def test_a_group_of_one_takes_every_route(pools):
    assert pools(1).run(solo_sized_allreduces, timeout=60) == [True]
