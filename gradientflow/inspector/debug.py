"""GRADIENTFLOW_DEBUG: a second check per collective, which names every rank's call.

Every call is already checked by default before it reaches the transport (the engine's
rounds: the smallest and largest signature of the ranks, refused on every rank). This mode
adds, before that, a small allgather of (sequence number, fingerprint) on a side group of its
own, so the error lists what each rank issued, and a solo allreduce that met another call on
the main transport is refused at once rather than found by the inspector. All-to-all, whose
sizes may differ between ranks, gets a second round checking what each rank sends against
what its peer expects. It costs one more small collective's latency per call, which is why it
is a debug mode.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

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

    def close(self) -> None:
        try:
            self._group.shutdown()
        except Exception:  # noqa: BLE001
            pass

    def check(self, seq: int, name: str, tensor: torch.Tensor | None, root: Any,
              reduce_op: Any, pair_bytes: Callable[[], tuple[list, list]] | None = None) -> None:
        """GRADIENTFLOW_DEBUG: agree on (sequence number, fingerprint) before the transport.

        `pair_bytes` (all-to-all, whose sizes may differ between ranks): returns the bytes
        this rank sends to and expects from each rank, checked pairwise in a second round.
        """
        self._fingerprint(seq, name, tensor, root, reduce_op)
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

    def _fingerprint(self, seq: int, name: str, tensor: torch.Tensor | None, root: Any,
                           reduce_op: Any) -> None:
        desc = describe(name, (tensor.dtype, tensor.shape) if tensor is not None else None,
                        root, reduce_op)
        fp = int(text_fingerprint(desc), 16)
        mine = torch.tensor([seq, fp], dtype=torch.int64)
        outs = [torch.zeros(2, dtype=torch.int64) for _ in range(self.world_size)]
        try:
            self._group.allgather([outs], [mine]).wait()
        except Exception as exc:  # noqa: BLE001
            raise self._explain(exc, seq, name) from exc
        if all(torch.equal(o, mine) for o in outs):
            return
        # Every rank sees the same gathered values, so every rank raises here, and nothing
        # reached the transport: the group stays usable.
        # Keyed by the check's own count (the same on every rank: one allgather each), not by
        # the sequence number, which a refused call does not advance.
        self._n += 1
        key = f"gradientflow/debug/{self._n}/"
        self._store.set(f"{key}{self.rank}", f"#{seq} {desc}")
        views = {}
        for r in range(self.world_size):
            try:
                views[r] = self._store.get(f"{key}{r}").decode()
            except Exception:  # noqa: BLE001
                views[r] = f"#{int(outs[r][0])} (fingerprint {int(outs[r][1]):08x})"
        diff = [r for r in range(self.world_size) if not torch.equal(outs[r], mine)]
        other = diff[0]
        raise CollectiveMismatchError(
            f"gradientflow: rank {self.rank}: collective mismatch at sequence number {seq} on "
            f"process group {self.name} (GRADIENTFLOW_DEBUG check): rank {self.rank} issued "
            f"{views[self.rank]} [fingerprint {fp:08x}], rank {other} issued {views[other]} "
            f"[fingerprint {int(outs[other][1]):08x}]. Every rank must issue the same "
            "collectives (op, dtype, shape, root, reduce op) in the same order; the call was "
            "refused before reaching the transport on every rank."
            + "".join(f"\n  rank {r}: {v}" for r, v in sorted(views.items())))
