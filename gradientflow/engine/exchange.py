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
    for `nbytes` each way; `cuts[frame]`: the (send, recv) slices a round of that frame size
    hands the transport."""

    __slots__ = ("send", "recv", "send_mem", "recv_mem", "send_ptr", "views", "cuts")

    def __init__(self, nbytes: int) -> None:
        self.send = torch.zeros(nbytes, dtype=torch.uint8)
        self.recv = torch.zeros(nbytes, dtype=torch.uint8)
        self.send_mem = memoryview(self.send.numpy())
        self.recv_mem = memoryview(self.recv.numpy())
        self.send_ptr = self.send.data_ptr()
        # (rank, dtype, shape, frame) -> that rank's payload in `recv`, typed and shaped: a
        # program repeats a few shapes, and three tensor views per call cost more than a lookup.
        self.views: dict = {}
        self.cuts: dict = {}


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

    def _buffers(self, frame: int) -> _Buffers:
        """This thread's buffers, with room for a round of `frame`-byte frames."""
        bufs = getattr(self._local, "bufs", None)
        n = self.world_size
        need = (n if _keeps_self_slot(frame) else max(1, n - 1)) * frame
        if bufs is None or bufs.send.numel() < need:
            bufs = self._local.bufs = _Buffers(need)
        self._local.frame = frame
        return bufs

    def _slot(self, r: int, frame: int) -> int:
        """Where peer `r`'s frame lies in a round's buffers, in frames."""
        return r if _keeps_self_slot(frame) else r - (r > self.rank)

    def _cut(self, bufs: _Buffers, frame: int) -> tuple:
        """(send, recv, splits) of a round of `frame`-byte frames (made once per size)."""
        cut = bufs.cuts.get(frame)
        if cut is None:
            if len(bufs.cuts) >= 64:  # a program repeating many sizes: keep a few
                bufs.cuts.clear()
            n = self.world_size
            if _keeps_self_slot(frame):
                cut = (bufs.send[:n * frame], bufs.recv[:n * frame], [])
            else:
                total = (n - 1) * frame
                splits = [0 if r == self.rank else frame for r in range(n)]
                cut = (bufs.send[:total], bufs.recv[:total], splits)
            bufs.cuts[frame] = cut
        return cut

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
        if nbytes > 0 and (payload.device.type != "cpu" or not payload.is_contiguous()):
            raise ValueError("Exchange.swap: the payload must be a contiguous CPU tensor")
        n, f, me = self.world_size, HEADER + cap, self.rank
        bufs = self._buffers(f)
        # The same frame to every other rank (_slot: where each lies).
        pack = _WORDS[k].pack_into
        mem = bufs.send_mem
        for r in range(n):
            if r != me:
                at = self._slot(r, f) * f
                pack(mem, at, k, nbytes, *words)
                if nbytes > 0:
                    ctypes.memmove(bufs.send_ptr + at + HEADER, payload.data_ptr(), nbytes)
        send, recv, splits = self._cut(bufs, f)
        try:
            if n > 1:
                self._wait(self._group.alltoall_base(recv, send, splits, splits))
        except BaseException:
            # The all-to-all may still be writing into them: the next round takes new ones.
            self._local.bufs = None
            raise
        every_words: list[list[int]] = []
        sizes: list[int] = []
        rmem = bufs.recv_mem
        for r in range(n):
            if r == me:  # this rank's own: as sent
                every_words.append(list(words))
                sizes.append(nbytes)
                continue
            at = self._slot(r, f) * f
            their_k, their_n = _HEAD.unpack_from(rmem, at)
            if not 0 <= their_k <= MAX_WORDS or their_n > cap:
                raise FrameError(f"rank {r} sent a frame that is not an agreement round "
                                 f"({their_k} words, {their_n} payload bytes)")
            every_words.append(list(_READ[their_k].unpack_from(rmem, at + 16)))
            sizes.append(their_n)
        return every_words, sizes

    def payload_of(self, r: int, like: torch.Tensor) -> torch.Tensor:
        """Peer `r`'s payload of this thread's last swap, as a tensor of `like`'s dtype and
        shape (a view of the receive buffer, valid until this thread's next swap)."""
        bufs = self._local.bufs
        f = self._local.frame
        key = (r, like.dtype, like.shape, f)
        view = bufs.views.get(key)
        if view is None:
            if len(bufs.views) >= 256:
                bufs.views.clear()
            start = self._slot(r, f) * f + HEADER
            nbytes = like.numel() * like.element_size()
            view = bufs.views[key] = bufs.recv[start:start + nbytes].view(like.dtype).view(
                like.shape)
        return view
