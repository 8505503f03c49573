"""Eager SUMs of two ranks on their own routes: inside the check round, or exchanged whole.

They must give gloo's bits (checks.own_route: a + b on one rank, b + a on the other), take
those routes exactly when the rule says so, and a call the ranks issued differently (another
size, a route one rank takes and the other not, another collective) is refused on every rank
with the group still usable.
"""
from __future__ import annotations

import pytest

DTYPES = ["float32", "float64", "int32", "int64", "float16"]


def inband_matches_gloo(rank, world, n_examples):
    """Rank body: random eager allreduces on gradientflow and on gloo, bit for bit; the
    route counters move exactly for the calls the rule sends those ways."""
    import torch
    import torch.distributed as dist
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    from gradientflow.backend import backend_of
    from gradientflow.engine.checks import EXCHANGE, INBAND, own_route

    gloo = dist.new_group(backend="gloo")
    stats = backend_of().engine.stats
    seen = {"inband": 0, "exchanged": 0, "sent": 0}

    @settings(max_examples=n_examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 2**30), dtype=st.sampled_from(DTYPES),
           shape=st.sampled_from([(), (1,), (7,), (1024,), (32, 32), (1025,), (3, 700),
                                  (512,), (300, 300), (2**20,), (2**20 + 8,)]),
           op=st.sampled_from(["SUM", "SUM", "SUM", "MAX"]),
           async_op=st.sampled_from([False, False, False, True]))
    def prop(seed, dtype, shape, op, async_op):
        ids = [None] * world
        dist.all_gather_object(ids, (seed, dtype, shape, op, async_op), group=gloo)
        assert all(i == ids[0] for i in ids), f"ranks run different examples: {ids}"
        dt = getattr(torch, dtype)
        g = torch.Generator().manual_seed(seed * 7 + rank)
        if dt.is_floating_point:
            x = torch.randn(shape, generator=g, dtype=torch.float64).mul(1e3).to(dt)
        else:
            x = torch.randint(-2**20, 2**20, shape, generator=g).to(dt)
        ours, theirs = x.clone(), x.clone()
        rop = getattr(dist.ReduceOp, op)
        before = (stats.inband, stats.exchanged)
        work = dist.all_reduce(ours, op=rop, async_op=async_op)
        if async_op:
            work.wait()
        dist.all_reduce(theirs, op=rop, group=gloo)
        assert torch.equal(ours, theirs), (
            f"rank {rank}: {dtype} {shape} {op} async={async_op}: differs from gloo")
        nbytes = x.numel() * x.element_size()
        # Below sync_fusion_limit or asynchronous, a small allreduce is fused, not eager;
        # from the solo threshold (4 MB) on it goes alone on the solo channel.
        eager = not async_op and 256 <= nbytes < 4 * 10**6
        route = own_route(x, rop, world) if eager else 0
        moved = (stats.inband - before[0], stats.exchanged - before[1])
        assert moved == (int(route == INBAND), int(route == EXCHANGE)), (
            rank, dtype, shape, op, async_op, moved)
        seen["inband" if route == INBAND else "exchanged" if route == EXCHANGE else "sent"] += 1

    prop()
    return seen


def test_inband_allreduce_is_gloo_bit_for_bit(pools):
    seen = pools(2).run(inband_matches_gloo, 80, timeout=240)
    assert min(seen[0].values()) >= 5, seen[0]


def refused_then_usable(rank, world, case):
    """Rank body: one disagreeing call, refused on every rank; then the group works."""
    import torch
    import torch.distributed as dist

    from gradientflow.errors import CollectiveMismatchError

    if case == "size":  # both in-band, different sizes
        x = torch.ones(1000 + 24 * rank)
        call = lambda: dist.all_reduce(x)  # noqa: E731
    elif case == "route":  # rank 0 in-band (4 KB), rank 1 exchanged (8 KB)
        x = torch.ones(1024 * (rank + 1))
        call = lambda: dist.all_reduce(x)  # noqa: E731
    elif case == "device":  # the same call, one rank's on a route of its own, the other's not
        x = torch.ones(100_000)
        call = lambda: dist.all_reduce(x)  # noqa: E731
    elif case == "dtype":  # the same bytes, another dtype: only the fingerprint tells
        x = torch.ones(512, dtype=torch.float64 if rank == 0 else torch.int64)
        call = lambda: dist.all_reduce(x)  # noqa: E731
    else:  # an in-band allreduce against a broadcast
        x = torch.ones(1024)
        call = ((lambda: dist.all_reduce(x)) if rank == 0
                else (lambda: dist.broadcast(x, src=0)))
    from gradientflow.engine import checks

    kept = checks._OWN_ROUTE_DTYPES
    if case == "device" and rank == 1:  # as if its tensor could not take the route (a GPU's)
        checks._OWN_ROUTE_DTYPES = frozenset()
    try:
        call()
        error = "no error"
    except CollectiveMismatchError as exc:
        error = str(exc)
    finally:
        checks._OWN_ROUTE_DTYPES = kept
    assert f"rank {rank}" in error and "collective mismatch" in error, (rank, error)
    assert "refused on every rank" in error, (rank, error)
    assert torch.equal(x, torch.ones_like(x)), f"rank {rank}: a refused call changed its tensor"
    y = torch.full((1024,), float(rank + 1))
    dist.all_reduce(y)
    assert torch.equal(y, torch.full((1024,), 3.0)), f"rank {rank}: group unusable after"
    return error


@pytest.mark.parametrize("case", ["size", "route", "dtype", "op", "device"])
def test_inband_mismatch_refused_on_every_rank(pools, case):
    msgs = pools(2).run(refused_then_usable, case, timeout=90, pg_timeout_s=20)
    assert all("sequence number" in m for m in msgs), msgs


def sync_calls_on_the_caller_thread(rank, world):
    """Rank body: synchronous own-route calls run whole on the caller's thread (the engine
    idle): no Work comes back, the result is gloo's, and a strided view gets its result."""
    import torch
    import torch.distributed as dist

    from gradientflow.backend import backend_of

    gloo = dist.new_group(backend="gloo")
    pg = dist.distributed_c10d._get_default_group()
    stats = backend_of().engine.stats
    out = []
    for n in (1024, 300_000):  # INBAND (4 KB), EXCHANGE (1.2 MB)
        base = torch.arange(2 * n, dtype=torch.float32).mul_(rank + 1)
        view, want = base[::2], base[::2].clone()
        fast = stats.fast_path
        opts = dist.AllreduceOptions()
        opts.asyncOp = False
        work = pg.allreduce([view], opts)  # a strided view: staged and written back
        dist.all_reduce(want, group=gloo)
        assert work is None, f"rank {rank}: a Work came back from a completed call: {work}"
        assert stats.fast_path == fast + 1, f"rank {rank}: n={n} not on the caller's thread"
        assert torch.equal(view, want), f"rank {rank}: n={n}: the view differs from gloo's"
        assert torch.equal(base[1::2], torch.arange(1, 2 * n, 2, dtype=torch.float32)
                           .mul_(rank + 1)), f"rank {rank}: n={n}: the gaps were written"
        out.append(n)
    return out


def test_sync_own_route_completes_in_the_call(pools):
    assert pools(2).run(sync_calls_on_the_caller_thread, timeout=90) == [[1024, 300_000]] * 2
