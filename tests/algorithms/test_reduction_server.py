"""reduction_server on 4 CPU workers with reducer processes: results, bytes, a reducer killed
mid-step, and its restart.

Rank 0 starts the reducers (`python -m gradientflow.reducer`) against the test's own store and
kills them at the end; every wait is bounded by the group timeout, and the harness's timeout
bounds the whole test.
"""
from __future__ import annotations

import datetime
import os
import subprocess
import sys

WORLD = 4
PG_TIMEOUT_S = 60.0  # reducers import torch first: slow on a loaded machine
EAGER_TIMEOUT_S = 20.0  # a missing reducer fails a message after 3/4 of it


def _start_reducer(index: int, reducers: int):
    import torch.distributed as dist

    from gradientflow.algorithms.reduction_server import root_store

    store = root_store(dist.distributed_c10d._get_default_store())
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-m", "gradientflow.reducer", "--workers", str(WORLD), "--reducers",
         str(reducers), "--index", str(index), "--store", f"127.0.0.1:{store.port}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


def rs_equals_ring(rank, world, reducers, n_examples):
    """Rank body: through `reducers` reducers, messages equal ring's; |D| each way."""
    import torch
    import torch.distributed as dist
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    from gradientflow.algorithms import algorithm_stats, reset_algorithm_stats

    procs = [_start_reducer(j, reducers) for j in range(reducers)] if rank == 0 else []
    try:
        pg = dist.new_group(backend="gradientflow",
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
                            pg_options={"algorithm": "reduction_server", "reducers": reducers})
        reset_algorithm_stats()

        @settings(max_examples=n_examples, derandomize=True, database=None, deadline=None,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(seed=st.integers(0, 2**30), dtype=st.sampled_from(["float32", "float64",
                                                                  "int64"]),
               sizes=st.lists(st.integers(1, 600_000), min_size=1, max_size=5),
               op=st.sampled_from(["SUM", "MAX", "MIN"]))
        def prop(seed, dtype, sizes, op):
            ids = [None] * world
            dist.all_gather_object(ids, (seed, dtype, sizes, op))
            assert all(i == ids[0] for i in ids), f"ranks run different examples: {ids}"
            dt = getattr(torch, dtype)
            rop = getattr(dist.ReduceOp, op)
            xs = []
            for i, n in enumerate(sizes):
                g = torch.Generator().manual_seed(seed + 7919 * i + rank)
                xs.append(torch.randint(-1000, 1000, (n,), generator=g).to(dt))
            want = [x.clone() for x in xs]
            for w in want:
                dist.all_reduce(w, op=rop)
            got = [x.clone() for x in xs]
            for w in [dist.all_reduce(g, op=rop, group=pg, async_op=True) for g in got]:
                w.wait()
            for i, (g, w) in enumerate(zip(got, want)):
                assert torch.equal(g, w), f"rank {rank}: tensor {i} ({op}) differs from ring"

        prop()
        dist.barrier()
        return algorithm_stats()
    finally:
        dist.barrier()
        _stop(procs)


def test_reduction_server_equals_ring_and_sends_each_byte_once(pools):
    stats = pools(WORLD).run(rs_equals_ring, 2, 8, timeout=300, pg_timeout_s=PG_TIMEOUT_S)
    for rank, s in enumerate(stats):
        r = s["reduction_server"]
        assert r["messages"] > 0, f"rank {rank}: nothing went through the reducers"
        assert r["recv_bytes"] == r["bytes"], (rank, r)
        # the message once, plus a 48-byte header per reducer and message
        assert r["bytes"] < r["sent_bytes"] <= r["bytes"] + 2 * 48 * r["messages"], (rank, r)


def reducer_killed(rank, world):
    """Rank body: reducer 1 of 2 is killed while messages are in flight; the message fails on
    every rank within the timeout, naming it; a restarted reducer is taken back."""
    import time

    import torch
    import torch.distributed as dist

    from gradientflow.algorithms import StepFailed

    procs = [_start_reducer(j, 2) for j in range(2)] if rank == 0 else []
    try:
        pg = dist.new_group(backend="gradientflow",
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
                            pg_options={"algorithm": "reduction_server", "reducers": 2})
        x = torch.ones(2**20)
        dist.all_reduce(x, group=pg)  # connected, served once
        assert torch.equal(x, torch.full_like(x, world)), f"rank {rank}: first message wrong"
        dist.barrier()
        outcomes = []
        took = []
        for i in range(3):
            y = torch.ones(16 * 2**20)  # 64 MB: the kill lands while it is on the wire
            t0 = time.monotonic()
            work = dist.all_reduce(y, group=pg, async_op=True)
            if i == 0 and rank == 0:
                procs[1].kill()
            try:
                work.wait()
                outcomes.append("ok")
            except StepFailed as exc:
                outcomes.append(str(exc))
            took.append(time.monotonic() - t0)
            if outcomes[-1] != "ok":
                break
        failed = outcomes[-1]
        assert failed != "ok", f"rank {rank}: the reducer's death failed nothing: {outcomes}"
        assert "reducer(s) [1]" in failed, f"rank {rank}: the error does not name it: {failed}"
        assert max(took) < PG_TIMEOUT_S + 5, f"rank {rank}: failure took {took}"
        # Restart reducer 1: the next message is served again.
        if rank == 0:
            procs[1].wait(timeout=10)
            procs[1] = _start_reducer(1, 2)
        z = torch.arange(1000, dtype=torch.float32) + rank
        dist.all_reduce(z, group=pg)
        want = 4 * torch.arange(1000, dtype=torch.float32) + 6
        assert torch.equal(z, want), f"rank {rank}: after the restart the sum is wrong"
        return len(outcomes)
    finally:
        dist.barrier()
        _stop(procs)


def test_reducer_killed_mid_step_fails_every_rank_then_is_taken_back(pools):
    counts = pools(WORLD).run(reducer_killed, timeout=200, pg_timeout_s=PG_TIMEOUT_S)
    assert len(set(counts)) == 1, f"ranks failed at different messages: {counts}"


def missing_reducer(rank, world):
    """Rank body: no reducer was started: the first message fails, naming what is missing."""
    import time

    import torch
    import torch.distributed as dist

    pg = dist.new_group(backend="gradientflow", timeout=datetime.timedelta(seconds=5),
                        pg_options={"algorithm": "reduction_server", "reducers": 1})
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(10), group=pg)
    except RuntimeError as exc:  # the inspector may add which op of which group it was
        assert "reducer(s) [0] of 1 did not join within" in str(exc), str(exc)
        assert "python -m gradientflow.reducer" in str(exc)
        return time.monotonic() - t0
    raise AssertionError(f"rank {rank}: an allreduce without reducers succeeded")


def test_missing_reducer_fails_with_a_sentence(pools):
    took = pools(WORLD).run(missing_reducer, timeout=120, pg_timeout_s=5.0)
    assert all(3.0 < t < 5.0 for t in took), f"not failed within the 5 s timeout: {took}"


def eager_fails(rank, world):
    """Rank body: a large synchronous allreduce (the eager route: no solo channel) and a small
    asynchronous one meet a dead reducer: StepFailed on every rank for both, and the group
    stays usable once the reducer is back, as on the fused route."""
    import torch
    import torch.distributed as dist

    from gradientflow.algorithms import StepFailed

    procs = [_start_reducer(0, 1)] if rank == 0 else []
    try:
        pg = dist.new_group(backend="gradientflow",
                            timeout=datetime.timedelta(seconds=EAGER_TIMEOUT_S),
                            # no solo channel: a large synchronous allreduce goes eagerly
                            pg_options={"algorithm": "reduction_server", "reducers": 1,
                                        "solo_channel": False})
        dist.all_reduce(torch.ones(10), group=pg)  # connected, served once
        dist.barrier()
        if rank == 0:
            procs[0].kill()
            procs[0].wait(timeout=10)
        dist.barrier()
        small = dist.all_reduce(torch.ones(10), group=pg, async_op=True)  # fused
        errors = []
        try:  # 64 MB, synchronous: the eager route
            dist.all_reduce(torch.ones(16 * 2**20), group=pg)
        except StepFailed as exc:
            errors.append(str(exc))
        try:
            small.wait()
        except StepFailed as exc:
            errors.append(str(exc))
        assert len(errors) == 2, f"rank {rank}: the dead reducer failed only {errors}"
        dist.barrier()
        if rank == 0:
            procs[0] = _start_reducer(0, 1)
        z = torch.arange(100, dtype=torch.float32) + rank
        dist.all_reduce(z, group=pg)
        assert torch.equal(z, 4 * torch.arange(100, dtype=torch.float32) + 6), \
            f"rank {rank}: after the restart the sum is wrong"
        return True
    finally:
        dist.barrier()
        _stop(procs)


def test_step_failed_on_an_eager_allreduce_leaves_the_group_usable(pools):
    assert all(pools(WORLD).run(eager_fails, timeout=200, pg_timeout_s=EAGER_TIMEOUT_S))
