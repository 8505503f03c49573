"""Keyed priority scheduling: ranks ready in different orders launch the same order."""
from __future__ import annotations

import pytest


def keyed_different_orders(rank, world, steps, single_stage, credit):
    import random
    import time

    import torch

    from gradientflow.backend import scheduler_of

    sched = scheduler_of()
    sched.credit_bytes = credit
    logs = []
    for step in range(steps):
        n = 12
        sched.begin(n)
        order = list(range(n))
        random.Random(step * 10 + rank).shuffle(order)  # readiness order differs per rank
        futs = {}

        def gen(key):
            out = yield torch.full((1000 * (1 + key % 3),), float(rank + key))
            return out

        for i, key in enumerate(order):
            if rank == 1 and i % 4 == 0:
                time.sleep(0.002)  # a slow rank: readiness really interleaves with rounds
            futs[key] = sched.submit(key, priority=key, gen=gen(key), device=torch.device("cpu"),
                                     nbytes=4000 * (1 + key % 3), single_stage=single_stage)
        for key, fut in futs.items():
            val = fut.wait()
            want = sum(r + key for r in range(world))
            assert torch.all(val == want), (key, val[:3])
        logs.append(list(sched.launch_log))
    return logs, sched.rounds


@pytest.mark.parametrize("single_stage,credit", [(False, 4 * 10**6), (True, 4 * 10**6),
                                                 (True, 1)])
def test_same_launch_order_on_every_rank_despite_readiness_order(pools, single_stage, credit):
    # credit=1: only MIN_IN_FLIGHT ops in flight, so launches wait for agreed completions.
    res = pools(2).run(keyed_different_orders, 5, single_stage, credit, timeout=120)
    (logs0, rounds0), (logs1, rounds1) = res
    assert logs0 == logs1, (logs0, logs1)
    assert rounds0 == rounds1
    for log in logs0:
        assert sorted(log) == list(range(12))


def idle_then_late(rank, world):
    """Rank body: no rounds while nothing is ready; a rank that submits late still pairs."""
    import time

    import torch
    import torch.distributed as dist

    from gradientflow.backend import scheduler_of

    sched = scheduler_of()
    sched.begin(3)
    r0 = sched.rounds
    time.sleep(0.05)  # observing idleness, not synchronising: a poller would run ~25 rounds
    idle_rounds = sched.rounds - r0

    def gen(key):
        out = yield torch.full((10,), float(key))
        return out

    futs = []
    if rank == 1:
        dist.barrier()  # rank 0 has submitted (its round waits for ours) before we submit
    for key in range(3):
        futs.append(sched.submit(key, key, gen(key), torch.device("cpu"), 40, single_stage=True))
    if rank == 0:
        dist.barrier()
    vals = [float(f.wait()[0]) for f in futs]
    return idle_rounds, vals, list(sched.launch_log), sched.rounds


def test_no_rounds_while_idle_and_a_late_rank_still_pairs(pools):
    res = pools(2).run(idle_then_late, timeout=60)
    for idle_rounds, vals, log, _ in res:
        assert idle_rounds == 0
        assert vals == [0.0, 2.0, 4.0]
        assert log == [0, 1, 2]
    assert res[0][3] == res[1][3]


def chain_and_tensor_path(rank, world, steps, fifo):
    """Rank body: submit_tensor ops with static priorities declared in begin()."""
    import random
    import time

    import torch

    from gradientflow.backend import scheduler_of

    sched = scheduler_of()
    sched.credit_bytes = 1  # spent at once: only the priority rule decides what is held
    n = 10
    logs, per_step = [], []
    for step in range(steps):
        prios = [n - 1 - k for k in range(n)] if fifo else list(range(n))
        r0 = sched.rounds
        sched.begin(n, prios)
        order = list(range(n - 1, -1, -1))  # backward order: the last key is ready first
        if not fifo:
            random.Random(step * 10 + rank).shuffle(order)  # readiness differs per rank
        futs = {}
        for i, key in enumerate(order):
            if rank == 1 and i % 3 == 0:
                time.sleep(0.002)  # a slow rank: readiness really interleaves with rounds
            futs[key] = sched.submit_tensor(key, prios[key], torch.full((100 * (1 + key),),
                                                                        float(rank + key)))
        for key, fut in futs.items():
            val = fut.wait()
            assert torch.all(val == sum(r + key for r in range(world))), (key, val[:3])
        logs.append(list(sched.launch_log))
        per_step.append(sched.rounds - r0)
    return logs, per_step


@pytest.mark.parametrize("fifo", [True, False])
def test_round_chain_and_submit_tensor(pools, fifo):
    res = pools(2).run(chain_and_tensor_path, 4, fifo, timeout=120)
    (logs0, rounds0), (logs1, rounds1) = res
    assert logs0 == logs1, (logs0, logs1)
    assert rounds0 == rounds1  # the same rounds on every rank, step by step
    for log, rounds in zip(logs0, rounds0):
        assert sorted(log) == list(range(10))
        if fifo:
            # Nothing can overtake in FIFO order: nothing is held for credit, no completion
            # round is due, at most one readiness round per key (fewer when batched).
            assert 1 <= rounds <= 10
            assert log == list(range(9, -1, -1))
