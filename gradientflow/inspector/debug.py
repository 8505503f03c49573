"""GRADIENTFLOW_DEBUG: a second check per collective, which names every rank's call.

Every call is already checked by default before it reaches the transport (the engine's
rounds: the smallest and largest signature of the ranks, refused on every rank). This mode
adds, before that, the ranks' agreement on the call (cross_rank.agree: a digest of its sequence
number and descriptor allgathered on a side group of its own, every rank's call read from the
store on a mismatch), so the error lists what each rank issued, and a solo allreduce that met
another call on the main transport is refused at once rather than found by the inspector.
All-to-all, whose sizes may differ between ranks, gets a second round checking what each rank
sends against what its peer expects. It costs one more small collective's latency per call,
which is why it is a debug mode.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from gradientflow.cross_rank import agree
from gradientflow.errors import CollectiveMismatchError
from gradientflow.fingerprint import describe, text_fingerprint


class DebugCheck:
    """The pre-transport check of one process group, on its own side group."""

    def __init__(self, rank: int, world_size: int, name: str, store: Any, group: Any,
                 explain: Callable[[BaseException, int, str], BaseException]) -> None:
        self.rank = rank
        self.world_size = world_size
        self.name = name
        self._store = store
        self._group = group
        self._explain = explain
        self._n = 0  # checks that found a mismatch (the same count on every rank)
        self._call: tuple[int, str] = (0, "")  # (sequence number, op) of the call checked

    def close(self) -> None:
        try:
            self._group.shutdown()
        except Exception:  # noqa: BLE001
            pass

    def check(self, seq: int, name: str, tensor: torch.Tensor | None, root: Any,
              reduce_op: Any, pair_bytes: Callable[[], tuple[list, list]] | None = None) -> None:
        """GRADIENTFLOW_DEBUG: agree on (sequence number, descriptor) before the transport.

        `pair_bytes` (all-to-all, whose sizes may differ between ranks): returns the bytes
        this rank sends to and expects from each rank, checked pairwise in a second round.
        """
        self._agree(seq, name, tensor, root, reduce_op)
        if pair_bytes is not None:  # the fingerprints agree: every rank runs this round too
            self._pairs(seq, name, *pair_bytes())

    def _pairs(self, seq: int, name: str, send: list, recv: list) -> None:
        """All-to-all: what rank i sends to rank j must be what j expects from i (gloo aborts
        the receiving process otherwise: 'Received data size doesn't match expected size')."""
        w = self.world_size
        mine = torch.tensor(list(send) + list(recv), dtype=torch.int64)
        outs = [torch.zeros(2 * w, dtype=torch.int64) for _ in range(w)]
        try:
            self._group.allgather([outs], [mine]).wait()
        except Exception as exc:  # noqa: BLE001
            raise self._explain(exc, seq, name) from exc
        bad = [(i, j, int(outs[i][j]), int(outs[j][w + i])) for i in range(w) for j in range(w)
               if int(outs[i][j]) != int(outs[j][w + i])]
        if not bad:
            return
        pairs = "; ".join(f"rank {i} sends {sb} bytes to rank {j}, which expects {rb}"
                          for i, j, sb, rb in bad[:8])
        raise CollectiveMismatchError(
            f"gradientflow: rank {self.rank}: collective mismatch at sequence number {seq} on "
            f"process group {self.name} (GRADIENTFLOW_DEBUG check): {name} sizes disagree "
            f"between ranks: {pairs}{' ...' if len(bad) > 8 else ''}. Make each rank's input "
            "split sizes match the output split sizes of the ranks it sends to; the call was "
            "refused before reaching the transport on every rank.")

    def _agree(self, seq: int, name: str, tensor: torch.Tensor | None, root: Any,
               reduce_op: Any) -> None:
        desc = describe(name, (tensor.dtype, tensor.shape) if tensor is not None else None,
                        root, reduce_op)
        self._call = (seq, name)
        found = agree(f"#{seq} {desc}", self, self.rank)
        if found is None:
            return
        # Every rank saw the same digests, so every rank raises here, and nothing reached the
        # transport: the group stays usable.
        views = found.descriptions
        other = found.other()

        def fp(view: str) -> str:  # the descriptor's CRC, as the inspector's messages show it
            return text_fingerprint(view.split(" ", 1)[-1])

        raise CollectiveMismatchError(
            f"gradientflow: rank {self.rank}: collective mismatch at sequence number {seq} on "
            f"process group {self.name} (GRADIENTFLOW_DEBUG check): rank {self.rank} issued "
            f"{views[self.rank]} [fingerprint {fp(views[self.rank])}], rank {other} issued "
            f"{views[other]} [fingerprint {fp(views[other])}]. Every rank must issue the same "
            "collectives (op, dtype, shape, root, reduce op) in the same order; the call was "
            "refused before reaching the transport on every rank."
            + "".join(f"\n  rank {r}: {v}" for r, v in enumerate(views)))

    # cross_rank.Exchange: the digests on the side group, the calls through the store
    def digests(self, words: list[int]) -> list[list[int]]:
        mine = torch.tensor(words, dtype=torch.int64)
        outs = [torch.zeros_like(mine) for _ in range(self.world_size)]
        try:
            self._group.allgather([outs], [mine]).wait()
        except Exception as exc:  # noqa: BLE001
            raise self._explain(exc, *self._call) from exc
        return [o.tolist() for o in outs]

    def descriptions(self, description: str) -> list[str]:
        # Keyed by the check's own count (the same on every rank: one allgather each), not by
        # the sequence number, which a refused call does not advance.
        self._n += 1
        key = f"gradientflow/debug/{self._n}/"
        self._store.set(f"{key}{self.rank}", description)
        views = []
        for r in range(self.world_size):
            try:
                views.append(self._store.get(f"{key}{r}").decode())
            except Exception:  # noqa: BLE001
                views.append("#? (its call could not be read from the store)")
        return views
