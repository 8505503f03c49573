"""Concurrency: collectives from several threads never crash or corrupt memory; where the
orders differ between ranks, the mismatch is reported; mixed async load stays flat."""
from __future__ import annotations

import pytest

FAST = {"GRADIENTFLOW_INSPECT_INTERVAL_S": "0.2"}


def threaded(rank, world, kind, n):
    """Rank body: two threads issue collectives at once (their interleaving differs per rank).

    Every result is either right or the rank raised a collective mismatch; never anything else.
    """
    import threading

    import torch
    import torch.distributed as dist

    results = {"right": 0, "wrong": 0, "mismatch": 0, "other": []}
    lock = threading.Lock()

    def body(tid):
        pending = []
        try:
            for i in range(n):
                if kind == "fused":  # small async allreduces: the engine's rounds check them
                    t = torch.full((3 + 2 * tid,), float(rank + 1))
                    pending.append((dist.all_reduce(t, async_op=True), t))
                    oks = []
                    if i % 7 == 6 or i == n - 1:  # every op is waited on and checked
                        for w, _ in pending:
                            w.wait()
                        oks = [bool((t == 3.0).all()) for _, t in pending]
                        pending.clear()
                else:  # sync eager calls, same shape, SUM in one thread, MAX in the other
                    t = torch.full((8,), float(rank + 1))
                    dist.all_reduce(t, op=dist.ReduceOp.SUM if tid == 0 else dist.ReduceOp.MAX)
                    oks = [t[0].item() == (3.0 if tid == 0 else 2.0)]
                with lock:
                    results["right"] += sum(oks)
                    results["wrong"] += len(oks) - sum(oks)
        except Exception as exc:  # noqa: BLE001
            with lock:
                if "collective mismatch" in str(exc):
                    results["mismatch"] += 1
                else:
                    results["other"].append(f"{type(exc).__name__}: {exc}"[:400])

    threads = [threading.Thread(target=body, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    results["alive"] = sum(th.is_alive() for th in threads)
    return results


@pytest.mark.parametrize("kind", ["fused", "sync"])
def test_threads_get_right_results_or_a_mismatch(pools, kind):
    res = pools(2).run(threaded, kind, 150, env=FAST, pg_timeout_s=10, timeout=120)
    for r in res:
        assert r["alive"] == 0, r  # no deadlock
        assert not r["other"], r["other"]  # only a clear mismatch may be raised
        if r["mismatch"] == 0:  # no mismatch reported: every one of the 2 x n ops was right
            assert r["right"] == 2 * 150 and r["wrong"] == 0, r
        elif kind == "fused":  # the round checks a batch before it is sent: never a wrong sum
            assert r["wrong"] == 0, r


def debug_threads(rank, world):
    """Rank body (GRADIENTFLOW_DEBUG): threads with different shapes: refused, never a crash."""
    import threading

    import torch
    import torch.distributed as dist

    errors, right = [], []  # list.append is atomic; `n += 1` from two threads loses counts

    def body(tid):
        for _ in range(20):
            t = torch.ones(4 + tid * 3)
            try:
                dist.all_reduce(t)
                right.append(bool((t == 2.0).all()))
            except Exception as exc:  # noqa: BLE001
                errors.append(str(exc)[:300])

    threads = [threading.Thread(target=body, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    return {"right": sum(right), "errors": errors, "alive": sum(th.is_alive() for th in threads)}


def test_debug_mode_refuses_threaded_shape_mismatch(pools):
    res = pools(2).run(debug_threads, env={"GRADIENTFLOW_DEBUG": "1"}, pg_timeout_s=10,
                       timeout=120)
    for r in res:
        assert r["alive"] == 0, r
        assert all("collective mismatch" in e for e in r["errors"]), r["errors"]
        assert r["right"] + len(r["errors"]) == 40, r


def mixed_async_load(rank, world, ops):
    """Rank body: a mixed async program (same on every rank); RSS after warm-up stays flat."""
    from benchmarks.soak import mixed_program  # the soak's program, at a test's size

    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    before = []

    def sample(i):
        if i == ops // 4:
            before.append(rss_mb())

    mixed_program(rank, world, ops, seed=3, max_n=500, flush_every=32, on_op=sample)
    return rss_mb() - before[0]


def test_mixed_async_load_on_four_ranks_is_flat(pools):
    growth = pools(4).run(mixed_async_load, 800, pg_timeout_s=30, timeout=240)
    assert max(growth) < 25.0, growth
