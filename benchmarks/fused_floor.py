"""The floor of a fusing Python backend: per-tensor calls into torch, the default's messages.

`bench_fusion.py`'s "gloo hand-fused" bound sends the messages the default configuration cuts
with no per-tensor call at all, so it leaves out what every per-tensor call into a backend
written in Python pays however little it does: torch's `dist.all_reduce` wrapper, its dispatch
into Python (the GIL taken back for the call), and one Work object per call. This backend pays
exactly that and nothing else: `allreduce` sends a tensor the default sends alone at once, on
the second gloo group (as the engine's solo channel does, so its transport overlaps the calls
that follow), and only appends any other tensor; the first `wait()` of a list packs those as
the hand-fused bound does (the same cut), sends them on the first group, waits for
everything, and unpacks. It has no check, no engine thread, no cycle time, and knows that the
whole list is issued before the first wait: it does less than any usable fusing backend in
Python would, so its time is a floor for one on this list; it is not a usable backend.

    dist.Backend.register_backend(NAME, creator(gloo, solo_gloo, fusion, solo), devices=["cpu"])
"""
from __future__ import annotations

from typing import Any, Callable

NAME = "fused_floor"


def creator(gloo: Any, solo_gloo: Any, fusion_threshold: int, solo_threshold: int) -> Callable:
    """A backend creator for `register_backend`: the floor above, sending on the given groups."""
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import Backend

    from gradientflow.engine.fusion import FusableOp, pack, plan_messages, solo_cut, unpack

    solo_bytes = solo_cut(fusion_threshold, solo_threshold)
    buffers: dict = {}  # (message index, elements, dtype) -> its packing buffer

    def flush(pending: list, works: list) -> None:
        """Send the pending tensors as the default cuts them, wait for them and `works` (the
        solos in flight), unpack (hand_fused's)."""
        ops = [FusableOp(i, t, ("cpu", t.dtype, 0), None, None) for i, t in enumerate(pending)]
        packed = []
        for i, m in enumerate(plan_messages(ops, fusion_threshold, solo_threshold)):
            # Buffers kept from list to list, as the bound's and the engine's are: a fresh
            # one of tens of MB pays its page faults again at every list.
            key = (i, m.numel, m.ops[0].tensor.dtype)
            flat = buffers.get(key)
            if flat is None:
                flat = buffers[key] = torch.empty(m.numel, dtype=m.ops[0].tensor.dtype)
            pack(m.ops, flat)
            works.append(dist.all_reduce(flat, group=gloo, async_op=True))
            packed.append((m, flat))
        for w in works:
            w.wait()
        for m, flat in packed:
            unpack(flat, m.ops)

    class FlushWork(dist.Work):
        """One call's Work: its first wait sends every call still pending."""

        def __init__(self, owner: Any) -> None:
            super().__init__()
            self._owner = owner

        def wait(self, timeout: Any = None) -> bool:
            owner = self._owner
            pending, works = owner.pending, owner.solos
            if pending or works:
                owner.pending, owner.solos = [], []
                flush(pending, works)
            return True

    class FusedFloor(Backend):
        """allreduce: a solo sent, any other tensor kept; a Work either way (module doc)."""

        def __init__(self, rank: int, size: int) -> None:
            super().__init__(rank, size)
            self.pending: list = []  # tensors to pack at the first wait
            self.solos: list = []  # Works of the tensors sent alone

        def allreduce(self, tensors, opts=None):
            t = tensors[0]
            if t.numel() * t.element_size() >= solo_bytes and t.is_contiguous():
                self.solos.append(dist.all_reduce(t, group=solo_gloo, async_op=True))
            else:
                self.pending.append(t)
            return FlushWork(self)

        def getBackendName(self) -> str:
            return NAME

    def create(store, rank: int, size: int, timeout) -> Any:
        return FusedFloor(rank, size)

    return create


def selftest_worker(rank: int, world_size: int) -> dict:
    """The floor's sums on a small list that makes both solo and packed messages: whether every
    tensor holds the sum over ranks after the waits (a floor that summed wrong bounds nothing)."""
    import torch
    import torch.distributed as dist

    gloo = dist.group.WORLD
    dist.Backend.register_backend(NAME, creator(gloo, dist.new_group(backend="gloo"), 4096, 1024),
                                  devices=["cpu"])
    floor = dist.new_group(backend=NAME)
    ok = True
    for _ in range(2):  # the second list: nothing left over from the first
        sizes = [300, 10, 700, 5, 64, 1000]  # elements: 1000 and 700 go alone (>= 1024 bytes)
        xs = [torch.full((n,), float(rank + 1 + i)) for i, n in enumerate(sizes)]
        works = [dist.all_reduce(x, group=floor, async_op=True) for x in xs]
        for w in works:
            w.wait()
        want = [sum(r + 1 + i for r in range(world_size)) for i in range(len(sizes))]
        ok = ok and all(bool((x == w).all()) for x, w in zip(xs, want))
    return {"ok": ok}
