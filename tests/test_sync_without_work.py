"""A transport that returns no Work for a synchronous call (NCCL does, for asyncOp=False).

torch's own collectives accept None from a backend for a synchronous call; the engine hands
the caller's options to the transport for an eager collective, so it must accept it too.
"""
from __future__ import annotations


def sync_call_with_no_work(rank, world, port):
    """Rank body: a synchronous allreduce queued behind async ones, on such a transport."""
    import datetime
    import os

    import torch
    import torch.distributed as dist

    import gradientflow  # noqa: F401 - registers the backend
    from gradientflow.backend import transports as T

    real = T.Transports.factories["gloo"]

    class NoWorkWhenSynchronous:
        """gloo, but a synchronous allreduce runs to its end and returns None, as NCCL's."""

        def __init__(self, pg):
            self._pg = pg

        def allreduce(self, tensors, opts=None):
            work = self._pg.allreduce(tensors, opts)
            if opts is not None and not getattr(opts, "asyncOp", True):
                work.wait()
                return None
            return work

        def __getattr__(self, name):
            return getattr(self._pg, name)

    T.Transports.factories["gloo"] = lambda *a: NoWorkWhenSynchronous(real(*a))
    # a long cycle: the async allreduces are still queued when the synchronous one comes
    os.environ["GRADIENTFLOW_CYCLE_TIME_MS"] = "1000"
    try:
        dist.init_process_group("gradientflow", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        small = [torch.full((10,), float(rank + 1)) for _ in range(5)]
        works = [dist.all_reduce(t, async_op=True) for t in small]
        big = torch.full((1 << 18,), float(rank + 1))  # 1 MB: eager, below the solo cut
        dist.all_reduce(big)
        for w in works:
            w.wait()
        want = float(sum(range(1, world + 1)))
        return bool((big == want).all()) and all(bool((t == want).all()) for t in small)
    finally:
        T.Transports.factories["gloo"] = real
        os.environ.pop("GRADIENTFLOW_CYCLE_TIME_MS", None)
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_synchronous_call_may_return_no_work(pools):
    from harness import free_port

    assert all(pools(2).run(sync_call_with_no_work, free_port(), backend=None, timeout=120))
