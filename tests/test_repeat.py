"""The backend's entry for a repeated synchronous allreduce (engine/sync_own.py: repeat).

It works out a call's checks, route and signature once per (dtype, shape, reduce op), so what
must hold is that nothing it skips shows: torch's sequence number moves per call, the result
is gloo's and comes back complete, a call it must not take (asynchronous, a view, another
route) goes the general way untouched, and a change of the routing settings is obeyed at once.
"""
from __future__ import annotations


def repeats_as_the_general_path(rank, world):
    """Rank body: repeated synchronous calls on the repeat path, then the cases it leaves."""
    import torch
    import torch.distributed as dist

    from gradientflow.backend import backend_of

    gloo = dist.new_group(backend="gloo")
    backend = backend_of()
    stats = backend.engine.stats
    taken = []
    repeat = backend.engine.repeat

    def counted(tensors, opts):
        done = repeat(tensors, opts)
        taken.append(done)
        return done

    backend.engine.repeat = counted
    config = backend.config
    try:
        for n in (1024, 300_000):  # in the round (4 KB); exchanged (1.2 MB)
            for i in range(3):
                x = torch.arange(n, dtype=torch.float32).mul_(rank + 1 + i)
                want = x.clone()
                seq = backend._get_sequence_number_for_group()
                taken.clear()
                dist.all_reduce(x)
                dist.all_reduce(want, group=gloo)
                assert taken == [True], f"rank {rank}: n={n} call {i}: repeat path {taken}"
                assert backend._get_sequence_number_for_group() == seq + 1, (
                    f"rank {rank}: n={n}: torch's sequence number did not move")
                assert torch.equal(x, want), f"rank {rank}: n={n} call {i}: differs from gloo"
        # What it must leave to the general path, with the same key known: an async call
        # and a strided view of the same dtype and shape.
        base = torch.arange(2048, dtype=torch.float32).mul_(rank + 1)
        for x, async_op in ((base[:1024].clone(), True), (base[::2], False)):
            want = x.clone()
            taken.clear()
            work = dist.all_reduce(x, async_op=async_op)
            if work is not None:
                work.wait()
            dist.all_reduce(want, group=gloo)
            assert taken in ([], [False]), f"rank {rank}: taken {taken} (async={async_op})"
            assert torch.equal(x, want), f"rank {rank}: async={async_op}: differs from gloo"
        # New routing settings: a 4 KB synchronous call is now fused (sync_fusion_limit),
        # so the route the repeat path knew for it must be forgotten.
        backend.reconfigure(backend.config.replace(sync_fusion_limit=8192))
        x = torch.full((1024,), float(rank + 1))
        before = (stats.inband, stats.deferred)
        taken.clear()
        dist.all_reduce(x)
        assert torch.equal(x, torch.full((1024,), 3.0)), f"rank {rank}: wrong sum after"
        assert (stats.inband, stats.deferred) == (before[0], before[1] + 1), (
            f"rank {rank}: a 4 KB call after the change did not take the fused route: "
            f"in-band {stats.inband - before[0]}, deferred {stats.deferred - before[1]}")
    finally:
        backend.engine.repeat = repeat
        backend.reconfigure(config)  # the pool's next test gets the group as it was
    return True


def test_the_repeat_path_is_the_general_path_for_less(pools):
    assert pools(2).run(repeats_as_the_general_path, timeout=120) == [True, True]
