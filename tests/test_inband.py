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


def repeated_calls_ride_in_their_round(rank, world, n_examples):
    """Rank body: Hypothesis sequences of exchanged-size calls (sizes repeated or changed, a
    small or a fused call between, some behind a pending async call so that they take the
    engine's general path): gloo's bits every time, an exchanged call counted as such."""
    import torch
    import torch.distributed as dist
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    from gradientflow.backend import backend_of

    gloo = dist.new_group(backend="gloo")
    stats = backend_of().engine.stats
    big, other = 2**18, 2**18 + 64  # 1 MB and a little more: both exchanged
    seen = {"carried": 0, "exchanged": 0, "general": 0}

    @settings(max_examples=n_examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 2**30),
           calls=st.lists(st.sampled_from(["big", "big", "big", "other", "small", "fused",
                                           "queued"]), min_size=1, max_size=8))
    def prop(seed, calls):
        ids = [None] * world
        dist.all_gather_object(ids, (seed, calls), group=gloo)
        assert all(i == ids[0] for i in ids), f"ranks run different examples: {ids}"
        dist.barrier()  # the example's calls start after the last one's rounds
        g = torch.Generator().manual_seed(seed * 7 + rank)
        for i, call in enumerate(calls):
            n = {"big": big, "queued": big, "other": other, "small": 64, "fused": 64}[call]
            x = torch.randn(n, generator=g)
            ours, theirs = x.clone(), x.clone()
            before = (stats.exchanged, stats.carried)
            fast = stats.fast_path
            # "queued": a fused async call still pending, so the engine is not idle
            pending = dist.all_reduce(torch.ones(16), async_op=True) if call == "queued" else None
            work = dist.all_reduce(ours, async_op=call == "fused")
            for w in (work, pending):
                if w is not None:
                    w.wait()
            dist.all_reduce(theirs, group=gloo)
            assert torch.equal(ours, theirs), f"rank {rank}: call {i} ({call}) differs from gloo"
            moved = (stats.exchanged - before[0], stats.carried - before[1])
            if call in ("small", "fused"):
                assert moved == (0, 0), (rank, i, calls, moved)
            else:
                assert moved[0] == 1, (rank, i, calls, moved)
                seen["carried"] += moved[1]
                seen["exchanged"] += 1
                seen["general"] += stats.fast_path == fast

    prop()
    # The last repeated sizes: three alike in a row, the third carried.
    before = stats.carried
    for _ in range(3):
        x = torch.ones(big)
        dist.all_reduce(x)
        assert torch.equal(x, torch.full((big,), 2.0)), f"rank {rank}: wrong sum"
    assert stats.carried - before >= 1, f"rank {rank}: a third repeat was not carried"
    return seen


def test_a_repeated_exchanged_call_rides_in_its_round(pools):
    seen = pools(2).run(repeated_calls_ride_in_their_round, 25, timeout=240)
    assert seen[0]["carried"] >= 3 and seen[0]["exchanged"] > seen[0]["carried"], seen[0]


def refused_in_a_carrying_round(rank, world, case):
    """Rank body: after two alike 1 MB calls the next round carries 1 MB; a call that differs
    there (larger than its room, or the same bytes of another dtype) is refused on every rank
    with its tensor untouched, and the group works after it, repeated calls included."""
    import torch
    import torch.distributed as dist

    from gradientflow.backend import backend_of
    from gradientflow.errors import CollectiveMismatchError

    stats = backend_of().engine.stats
    big = 2**18
    for _ in range(2):
        dist.all_reduce(torch.ones(big))
    if case == "larger":
        x = torch.ones(big * (1 + rank))
    else:
        x = torch.ones(big if rank == 0 else big // 2,
                       dtype=torch.float32 if rank == 0 else torch.float64)
    try:
        dist.all_reduce(x)
        error = "no error"
    except CollectiveMismatchError as exc:
        error = str(exc)
    assert f"rank {rank}" in error and "refused on every rank" in error, (rank, error)
    assert torch.equal(x, torch.ones_like(x)), f"rank {rank}: a refused call changed its tensor"
    before = stats.carried
    for _ in range(3):
        y = torch.full((big,), float(rank + 1))
        dist.all_reduce(y)
        assert torch.equal(y, torch.full((big,), 3.0)), f"rank {rank}: group unusable after"
    assert stats.carried - before == 1, f"rank {rank}: {stats.carried - before} carried"
    return error


@pytest.mark.parametrize("case", ["larger", "dtype"])
def test_a_mismatch_in_a_carrying_round_is_refused(pools, case):
    msgs = pools(2).run(refused_in_a_carrying_round, case, timeout=90, pg_timeout_s=20)
    assert all("sequence number" in m for m in msgs), msgs


def carried_on_the_general_path(rank, world):
    """Rank body: under GRADIENTFLOW_DEBUG (sync_own.py is not taken: every eager call goes
    as a Claim or a queued op, issue.py) the third of three alike 1 MB calls is carried in
    its round, with gloo's sum, and a larger call after them goes by the exchange."""
    import torch
    import torch.distributed as dist

    from gradientflow.backend import backend_of

    stats = backend_of().engine.stats
    carried = stats.carried
    for i in range(3):
        x = torch.full((2**18,), float(rank + 1))
        dist.all_reduce(x)
        assert torch.equal(x, torch.full_like(x, 3.0)), f"rank {rank}: call {i}: wrong sum"
    y = torch.full((2**18 + 8,), float(rank + 1))
    dist.all_reduce(y)
    assert torch.equal(y, torch.full_like(y, 3.0)), f"rank {rank}: the larger call: wrong sum"
    return stats.carried - carried


def test_a_repeated_call_rides_in_its_round_on_the_general_path(pools):
    assert pools(2).run(carried_on_the_general_path,
                        env={"GRADIENTFLOW_DEBUG": "1"}) == [1, 1]


BCAST_DTYPES = ["float32", "float64", "int64", "int32", "float16", "bfloat16", "uint8", "bool",
                "complex64"]


def broadcasts_match_gloo(rank, world, n_examples):
    """Rank body: random eager broadcasts on gradientflow and on gloo, bit for bit, each made
    twice: a broadcast of two ranks up to CARRY_BYTES is carried in its round when the round
    has room (always at the repeat), a larger one never; strided views get their result."""
    import torch
    import torch.distributed as dist
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    from gradientflow.backend import backend_of
    from gradientflow.engine.checks import CARRIED, broadcast_route

    gloo = dist.new_group(backend="gloo")
    stats = backend_of().engine.stats
    seen = {"carried": 0, "sent": 0}

    @settings(max_examples=n_examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 2**30), dtype=st.sampled_from(BCAST_DTYPES),
           shape=st.sampled_from([(), (3,), (1024,), (2420,), (4100,), (64, 255), (16384,),
                                  (16385,), (40000,)]),
           root=st.sampled_from([0, 1]), strided=st.booleans(),
           async_op=st.sampled_from([False, False, True]))
    def prop(seed, dtype, shape, root, strided, async_op):
        ids = [None] * world
        dist.all_gather_object(ids, (seed, dtype, shape, root, strided, async_op), group=gloo)
        assert all(i == ids[0] for i in ids), f"ranks run different examples: {ids}"
        dt = getattr(torch, dtype)
        g = torch.Generator().manual_seed(seed * 7 + rank)
        for repeat in range(2):
            base = torch.randn(shape + (2,) if strided else shape, generator=g,
                               dtype=torch.float64).mul(1e3)
            base = base.to(dt) if dt.is_floating_point or dt.is_complex else (
                base.to(torch.int64).to(dt))
            x = base[..., 0] if strided else base  # every other element: a strided view
            ours, theirs = x, x.clone()
            before = stats.bcast_carried
            work = dist.broadcast(ours, src=root, async_op=async_op)
            if async_op:
                work.wait()
            dist.broadcast(theirs, src=root, group=gloo)
            assert torch.equal(ours, theirs), (
                f"rank {rank}: {dtype} {shape} root {root} strided={strided} repeat {repeat}: "
                "differs from gloo")
            moved = stats.bcast_carried - before
            route = broadcast_route(x, world)
            if route != CARRIED:
                assert moved == 0, (rank, dtype, shape, "carried past its size")
            elif repeat == 1:
                assert moved == 1, (rank, dtype, shape, "a repeated broadcast not carried")
            seen["carried" if moved else "sent"] += 1

    prop()
    return seen


def test_broadcast_carried_in_its_round_is_gloo_bit_for_bit(pools):
    seen = pools(2).run(broadcasts_match_gloo, 40, timeout=240)
    assert min(seen[0].values()) >= 5, seen[0]


def broadcast_refused_then_usable(rank, world, case):
    """Rank body: two alike 9.6 KB broadcasts keep room for that size; a broadcast that then
    differs (another root, another size, a broadcast against an allreduce) is refused on every
    rank with its tensor untouched, and the group works after it, carried broadcasts too."""
    import torch
    import torch.distributed as dist

    from gradientflow.backend import backend_of
    from gradientflow.errors import CollectiveMismatchError

    stats = backend_of().engine.stats
    n = 2420
    for _ in range(2):
        y = torch.full((n,), float(rank))
        dist.broadcast(y, src=0)
        assert torch.equal(y, torch.zeros(n)), f"rank {rank}: wrong broadcast"
    x = torch.full((n + (24 * rank if case == "size" else 0),), float(rank + 5))
    if case == "root":
        call = lambda: dist.broadcast(x, src=rank)  # noqa: E731
    elif case == "op":
        call = ((lambda: dist.broadcast(x, src=0)) if rank == 0
                else (lambda: dist.all_reduce(x)))
    else:
        call = lambda: dist.broadcast(x, src=0)  # noqa: E731
    try:
        call()
        error = "no error"
    except CollectiveMismatchError as exc:
        error = str(exc)
    assert f"rank {rank}" in error and "refused on every rank" in error, (rank, error)
    assert torch.equal(x, torch.full_like(x, float(rank + 5))), (
        f"rank {rank}: a refused call changed its tensor")
    before = stats.bcast_carried
    for _ in range(2):
        y = torch.full((n,), float(rank + 1))
        dist.broadcast(y, src=1)
        assert torch.equal(y, torch.full((n,), 2.0)), f"rank {rank}: group unusable after"
    assert stats.bcast_carried - before >= 1, f"rank {rank}: no broadcast carried after"
    return error


@pytest.mark.parametrize("case", ["root", "size", "op"])
def test_a_broadcast_mismatch_in_a_carrying_round_is_refused(pools, case):
    msgs = pools(2).run(broadcast_refused_then_usable, case, timeout=90, pg_timeout_s=20)
    assert all("sequence number" in m for m in msgs), msgs


def rooms_keep_payloads_aligned(rank, world):
    """Rank body: a room of a size that is no multiple of 8 (two exchanged allreduces of 1025
    float32) before an in-band float64 allreduce and an int64 broadcast: both land whole."""
    import torch
    import torch.distributed as dist

    for _ in range(2):
        x = torch.ones(1025)
        dist.all_reduce(x)
    y = torch.full((64,), float(rank + 1), dtype=torch.float64)
    dist.all_reduce(y)
    assert torch.equal(y, torch.full_like(y, 3.0)), f"rank {rank}: wrong float64 sum"
    z = torch.full((9,), rank + 7, dtype=torch.int64)
    dist.broadcast(z, src=1)
    assert torch.equal(z, torch.full_like(z, 8)), f"rank {rank}: wrong int64 broadcast"
    return True


def test_an_odd_room_keeps_later_payloads_aligned(pools):
    assert pools(2).run(rooms_keep_payloads_aligned, timeout=90) == [True, True]
