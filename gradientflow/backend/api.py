"""Engine entry points for the layers above (hooks, optimizer), by process group."""
from __future__ import annotations

import contextlib
from typing import Hashable, Iterator

import torch

from gradientflow.backend.registry import backend_of
from gradientflow.engine.stages import Fuser, StageGen, drive, fuse


def submit_stages(group, key: Hashable, gen: StageGen, device: torch.device | None = None,
                  name: str = "stages", dense_bytes: int = 0) -> torch.futures.Future:
    """Run a multi-stage op (e.g. a compressed bucket) over `group`; returns a Future of its result.

    A plain StageGen: fused (engine.stages.fuse) only with stage ops queued beside it.
    """
    return submit_part(group, key, gen, fuse, device, name, dense_bytes, close=True)


def submit_part(group, key: Hashable, part, fuser: Fuser, device: torch.device | None = None,
                name: str = "stages", dense_bytes: int = 0,
                close: bool = True) -> torch.futures.Future:
    """Run one op of a fusable multi-stage batch over `group`; returns a Future of its result.

    `fuser([part, ...])` is the StageGen of a batch of such ops, returning their results in
    order (engine.stages). On a gradientflow group the engine fuses the ops queued together
    (of one fuser; `dense_bytes` counts towards the fusion threshold; `close`: the last op of
    its batch, e.g. a step's last bucket) and runs every stage on its thread in issue order,
    so no collective of one batch interleaves with another's differently on different ranks.
    On any other backend (or without torch.distributed initialised, where each stage is the
    identity of a one-rank group) the op runs here alone, synchronously.
    """
    backend = backend_of(group)
    if backend is not None:
        return backend.engine.stages(name, part, device or torch.device("cpu"), key,
                                     dense_bytes, fuser, close)
    import torch.distributed as dist

    fut = torch.futures.Future()
    try:
        gen = fuser([part])
        if dist.is_available() and dist.is_initialized():
            result = drive(gen, lambda t: dist.all_reduce(t, group=group))
        else:
            result = drive(gen, lambda t: None)
        fut.set_result(result[0])
    except Exception as exc:  # noqa: BLE001 - delivered through the future
        fut.set_exception(exc)
    return fut


def flush(group=None) -> None:
    """Ask the engine to agree on every queued allreduce now (a local hint: results never
    change)."""
    backend = backend_of(group)
    if backend is not None:
        backend.engine.flush()


def allreduce_async(group, tensor: torch.Tensor,
                    priority: int | None = None) -> torch.futures.Future:
    """A SUM allreduce of `tensor`, in place and asynchronous; the future completes with it.

    On a gradientflow group it joins the engine's ordered stream, `priority` placing it among
    the ops one round agrees (lower first; the optimizer's partitions: first layer first). On
    any other group it is torch's asynchronous all_reduce; without torch.distributed
    initialised, a one-rank group's identity.
    """
    import torch.distributed as dist

    backend = backend_of(group)
    if backend is not None:
        return backend.allreduce([tensor], None, priority=priority).get_future()
    if dist.is_available() and dist.is_initialized():
        return dist.all_reduce(tensor, group=group, async_op=True).get_future()
    fut = torch.futures.Future()
    fut.set_result([tensor])
    return fut


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False) -> None:
    """`dist.monitored_barrier` that also works on a gradientflow group before torch 2.14.

    torch before 2.14 accepts a monitored barrier on groups whose backend is named "gloo"
    only; a gradientflow group runs gloo's own on its CPU transport (backend/p2p.py), so it is
    called here directly. Any other group goes to torch. `timeout`: a timedelta (default: the
    group's timeout).
    """
    backend = backend_of(group)
    if backend is None:
        import torch.distributed as dist

        dist.monitored_barrier(group, timeout, wait_all_ranks)
        return
    backend.monitored_barrier(timeout, wait_all_ranks)


@contextlib.contextmanager
def waited(group=None) -> Iterator[None]:
    """Issue allreduces that the caller waits on together, right after the block.

    On a gradientflow group their batch is agreed only once the block ends (so they fuse,
    however slow the caller is), and as the caller waits on them, a round that finds the ranks
    issued them differently refuses them on every rank and the group stays usable. Only
    deferred allreduces may be issued inside: anything else waits for the block to end.
    Elsewhere it does nothing.
    """
    backend = backend_of(group)
    if backend is None:
        yield
        return
    with backend.engine.waited():
        yield
