"""Keyed priority scheduling: ranks ready in different orders launch the same order."""
from __future__ import annotations


def keyed_different_orders(rank, world, steps):
    import random
    import time

    import torch

    from gradientflow.engine import scheduler_of

    sched = scheduler_of()
    logs = []
    for step in range(steps):
        n = 12
        sched.begin(n)
        order = list(range(n))
        random.Random(step * 10 + rank).shuffle(order)  # readiness order differs per rank
        futs = {}

        def gen(key):
            out = yield torch.full((1000,), float(rank + key))
            return out

        for i, key in enumerate(order):
            if rank == 1 and i % 4 == 0:
                time.sleep(0.002)  # a slow rank: readiness really interleaves with rounds
            futs[key] = sched.submit(key, priority=key, gen=gen(key), device=torch.device("cpu"),
                                     nbytes=4000)
        for key, fut in futs.items():
            val = fut.wait()
            want = sum(r + key for r in range(world))
            assert torch.all(val == want), (key, val[:3])
        logs.append(list(sched.launch_log))
    return logs, sched.rounds


def test_same_launch_order_on_every_rank_despite_readiness_order(pools):
    res = pools(2).run(keyed_different_orders, 5, timeout=120)
    (logs0, rounds0), (logs1, rounds1) = res
    assert logs0 == logs1, (logs0, logs1)
    assert rounds0 == rounds1
    for log in logs0:
        assert sorted(log) == list(range(12))
