"""One message each way between every pair of ranks: a round's words, and a payload.

The agreement rounds (rounds.py) send every rank's words to every other rank in one all-to-all
of the side group. gloo aborts the process when the bytes a peer sends differ from the bytes
expected, so every rank sends frames of the same size (`HEADER + cap`) whatever it holds: a
peer that sent a round of another length, or another kind of round, is read and named instead.
The cap is the caller's, the same on every rank: a function of what the group's earlier rounds
agreed (rounds.py), never of what this rank holds now.

The frame can carry a payload: a synchronous allreduce of two ranks travels inside its own
check round (checks.own_route), so it costs one exchange instead of a round and then the
transport's allreduce.

Frame: int64 [nwords, payload bytes or -1], the words, then (from HEADER bytes on) the
payload. A reader reads only the words and payload bytes the header announces, so whatever a
reused buffer held beyond them is never read. A large frame is not sent by a rank to itself.
"""
from __future__ import annotations

import ctypes
import struct
import threading
from typing import Any, Callable

import torch

MAX_WORDS = 30  # the longest round any caller sends (rounds.py sends 1-3 words)
HEADER = 8 * (2 + MAX_WORDS)  # 256 bytes: keeps the payload 8-byte aligned for any dtype
_HEAD = struct.Struct("<qq")
_WORDS = [struct.Struct(f"<{2 + k}q") for k in range(MAX_WORDS + 1)]  # header with k words
_READ = [struct.Struct(f"<{k}q") for k in range(MAX_WORDS + 1)]


class FrameError(RuntimeError):
    """A peer's frame is not one this rank can read."""


class _Buffers:
    """One thread's send and receive frames (tensors, and writable views for struct), room
    for `nbytes` each way; `plans[frame]`: a round of that frame size (_Plan)."""

    __slots__ = ("send", "recv", "send_mem", "recv_mem", "send_ptr", "plans")

    def __init__(self, nbytes: int) -> None:
        self.send = torch.zeros(nbytes, dtype=torch.uint8)
        self.recv = torch.zeros(nbytes, dtype=torch.uint8)
        self.send_mem = memoryview(self.send.numpy())
        self.recv_mem = memoryview(self.recv.numpy())
        self.send_ptr = self.send.data_ptr()
        self.plans: dict = {}


class _Plan:
    """A round of one frame size on one thread's buffers, laid out once: the (send, recv,
    splits) the transport is handed, where each peer's frame lies in them (`peers`: (rank,
    byte offset)), and each peer's payload as a typed view (`views`, by (rank, dtype, shape):
    a program repeats a few shapes, and three tensor views per call cost more than a lookup)."""

    __slots__ = ("bufs", "send", "recv", "splits", "peers", "views")

    def __init__(self, bufs: _Buffers, frame: int, rank: int, world_size: int) -> None:
        n = world_size
        self.bufs = bufs
        if _keeps_self_slot(frame):
            total, self.splits = n * frame, []
            slot = list(range(n))
        else:
            total = (n - 1) * frame
            self.splits = [0 if r == rank else frame for r in range(n)]
            slot = [r - (r > rank) for r in range(n)]
        self.send, self.recv = bufs.send[:total], bufs.recv[:total]
        self.peers = tuple((r, slot[r] * frame) for r in range(n) if r != rank)
        self.views: dict = {}


# Frames up to this size keep a slot for the rank itself (never read): one all-to-all of equal
# parts, gloo's quickest for small frames. Larger ones leave it out, which saves gloo copying
# a large frame to itself.
_SELF_SLOT_MAX = 64 * 1024


def _keeps_self_slot(frame: int) -> bool:
    """Whether a round of `frame`-byte frames lays out a slot for every rank, its own included
    (the layout every rank derives alike from the frame size)."""
    return frame <= _SELF_SLOT_MAX


class Exchange:
    """Rounds on one gloo group: `swap` sends this rank's frame to every rank and returns
    every rank's words and payload.

    `payload_cap`: the payload room of a round whose caller names none (the same on every
    rank); `wait(work)` blocks on the all-to-all (rounds.py waits in slices, so that a fault
    found meanwhile ends it).
    """

    def __init__(self, group: Any, rank: int, world_size: int, payload_cap: int,
                 wait: Callable[[Any], None]) -> None:
        self._group = group
        self.rank = rank
        self.world_size = world_size
        self.payload_cap = payload_cap
        self._wait = wait
        # Buffers per thread: a round on the engine thread and one on a caller's never share
        # them, and a thread's next round starts only after its last one was read.
        self._local = threading.local()

    def _plan(self, frame: int) -> _Plan:
        """This thread's plan of a round of `frame`-byte frames (made once per size and
        buffer; the thread's last plan, which payload_of reads)."""
        local = self._local
        bufs = getattr(local, "bufs", None)
        plan = None if bufs is None else bufs.plans.get(frame)
        if plan is None:
            n = self.world_size
            need = (n if _keeps_self_slot(frame) else max(1, n - 1)) * frame
            if bufs is None or bufs.send.numel() < need:
                bufs = local.bufs = _Buffers(need)
            if len(bufs.plans) >= 64:  # a program repeating many sizes: keep a few
                bufs.plans.clear()
            plan = bufs.plans[frame] = _Plan(bufs, frame, self.rank, n)
        local.plan = plan
        return plan

    def swap(self, words: list[int], payload: torch.Tensor | None = None,
             cap: int | None = None) -> tuple[list[list[int]], list[int]]:
        """Every rank's words and payload size in bytes (-1 where a rank sent none), by rank;
        `payload_of` reads a peer's payload until this thread's next swap. `cap`: this
        round's payload room (every rank must name the same; default `payload_cap`). Raises
        FrameError on a frame that cannot be read."""
        k = len(words)
        if k > MAX_WORDS:
            raise ValueError(f"Exchange.swap: at most {MAX_WORDS} words, got {k}")
        cap = self.payload_cap if cap is None else cap
        nbytes = -1 if payload is None else payload.numel() * payload.element_size()
        if nbytes > cap:
            raise ValueError(f"Exchange.swap: a payload of {nbytes} bytes exceeds the "
                             f"{cap} every rank can receive in this round")
        if nbytes > 0 and (not payload.is_cpu or not payload.is_contiguous()):
            raise ValueError("Exchange.swap: the payload must be a contiguous CPU tensor")
        # Every slot starts 8-byte aligned, so a payload of any dtype can be viewed in place
        # whatever room an earlier round had (a room of 4100 bytes would misalign the next).
        plan = self._plan(HEADER + (cap + 7) // 8 * 8)
        bufs = plan.bufs
        # The same frame to every other rank.
        pack = _WORDS[k].pack_into
        mem = bufs.send_mem
        for _, at in plan.peers:
            pack(mem, at, k, nbytes, *words)
            if nbytes > 0:
                ctypes.memmove(bufs.send_ptr + at + HEADER, payload.data_ptr(), nbytes)
        try:
            if plan.peers:
                self._wait(self._group.alltoall_base(plan.recv, plan.send, plan.splits,
                                                     plan.splits))
        except BaseException:
            # The all-to-all may still be writing into them: the next round takes new ones.
            self._local.bufs = None
            raise
        every_words: list[list[int]] = [list(words)] * self.world_size  # this rank's: as sent
        sizes: list[int] = [nbytes] * self.world_size
        rmem = bufs.recv_mem
        for r, at in plan.peers:
            their_k, their_n = _HEAD.unpack_from(rmem, at)
            if not 0 <= their_k <= MAX_WORDS or their_n > cap:
                raise FrameError(f"rank {r} sent a frame that is not an agreement round "
                                 f"({their_k} words, {their_n} payload bytes)")
            every_words[r] = list(_READ[their_k].unpack_from(rmem, at + 16))
            sizes[r] = their_n
        return every_words, sizes

    def payload_of(self, r: int, like: torch.Tensor) -> torch.Tensor:
        """Peer `r`'s payload of this thread's last swap, as a tensor of `like`'s dtype and
        shape (a view of the receive buffer, valid until this thread's next swap)."""
        plan = self._local.plan
        key = (r, like.dtype, like.shape)
        view = plan.views.get(key)
        if view is None:
            if len(plan.views) >= 256:
                plan.views.clear()
            start = dict(plan.peers)[r] + HEADER
            nbytes = like.numel() * like.element_size()
            view = plan.views[key] = plan.recv[start:start + nbytes].view(like.dtype).view(
                like.shape)
        return view
