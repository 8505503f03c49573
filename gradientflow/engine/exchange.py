"""One message each way between every pair of ranks: a round's words, and a small payload.

The agreement rounds (rounds.py) send every rank's words to every other rank in one all-to-all
of the side group. gloo aborts the process when the bytes a peer sends differ from the bytes
expected, so every rank sends a frame of the same fixed size (`HEADER + payload_cap`, a
function of the world size alone) whatever it holds: a peer that sent a round of another
length, or another kind of round, is read and named instead.

The frame can carry a payload: a small synchronous allreduce of two ranks travels inside its
own check round (checks.own_route), so it costs one exchange instead of a round and then the
transport's allreduce.

Frame: int64 [nwords, payload bytes or -1], the words, zeros up to HEADER bytes, the payload.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

MAX_WORDS = 30  # the longest round any caller sends (rounds.py sends 1-3 words)
HEADER = 8 * (2 + MAX_WORDS)  # 256 bytes: keeps the payload 8-byte aligned for any dtype


class FrameError(RuntimeError):
    """A peer's frame is not one this rank can read."""


class Exchange:
    """Rounds on one gloo group: `swap` sends this rank's frame to every rank and returns
    every rank's words and payload.

    `payload_cap`: the largest payload any rank may send (the same on every rank);
    `wait(work)` blocks on the all-to-all (rounds.py waits in
    slices, so that a fault found meanwhile ends it).
    """

    def __init__(self, group: Any, rank: int, world_size: int, payload_cap: int,
                 wait: Callable[[Any], None]) -> None:
        self._group = group
        self.rank = rank
        self.world_size = world_size
        self.payload_cap = payload_cap
        self._wait = wait
        self.frame = HEADER + payload_cap

    def swap(self, words: list[int], payload: torch.Tensor | None = None
             ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Every rank's words and payload bytes (uint8, None where a rank sent none), by rank.
        Raises FrameError on a frame that cannot be read."""
        k = len(words)
        if k > MAX_WORDS:
            raise ValueError(f"Exchange.swap: at most {MAX_WORDS} words, got {k}")
        nbytes = -1 if payload is None else payload.numel() * payload.element_size()
        if nbytes > self.payload_cap:
            raise ValueError(f"Exchange.swap: a payload of {nbytes} bytes exceeds the "
                             f"{self.payload_cap} every rank can receive")
        # Buffers of this round's own: a round on the engine thread and one on a caller's
        # never share them, whatever their order.
        n, f = self.world_size, self.frame
        send = torch.zeros(n * f, dtype=torch.uint8)
        recv = torch.empty(n * f, dtype=torch.uint8)
        mine = send[:f]
        head = mine[:HEADER].view(torch.int64)
        head[:2 + k] = torch.tensor([k, nbytes, *words], dtype=torch.int64)
        if nbytes > 0:
            mine[HEADER:HEADER + nbytes].copy_(payload.reshape(-1).view(torch.uint8))
        for r in range(1, n):  # the same frame to every rank
            send[r * f:(r + 1) * f].copy_(mine)
        self._wait(self._group.alltoall_base(recv, send, [], []))
        every_words: list[list[int]] = []
        every_payload: list[torch.Tensor | None] = []
        for r in range(n):
            buf = recv[r * f:(r + 1) * f]
            their_k, their_n = buf[:16].view(torch.int64).tolist()
            if not 0 <= their_k <= MAX_WORDS or their_n > self.payload_cap:
                raise FrameError(f"rank {r} sent a frame that is not an agreement round "
                                 f"({their_k} words, {their_n} payload bytes)")
            every_words.append(buf[16:16 + 8 * their_k].view(torch.int64).tolist())
            every_payload.append(None if their_n < 0 else buf[HEADER:HEADER + their_n])
        return every_words, every_payload
