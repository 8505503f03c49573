"""The agreement round on the side group: which deferred ops every rank has queued.

Runs on the engine thread. The words and their reading are pure (agreement.py); this module
sends them, and when the ranks queued different allreduces, gathers every rank's view of the
batch for the error.
"""
from __future__ import annotations

import pickle
import time
from typing import Any

import torch
from torch._C._distributed_c10d import AllreduceOptions, ReduceOp

from gradientflow.engine.agreement import batch_fingerprint, read_round, round_words, verdict
from gradientflow.engine.fusion import FusableOp
from gradientflow.errors import EngineError
from gradientflow.observability import timeline as tl
from gradientflow.observability.timeline import TIMELINE, now_us


class Rounds:
    """Agreement rounds of one process group, on its side group `group` (never the data's)."""

    def __init__(self, rank: int, world_size: int, group: Any, stats: Any) -> None:
        self.rank = rank
        self.world_size = world_size
        self._group = group
        self._stats = stats

    def agree(self, candidates: list) -> int:
        """How many of `candidates` (this rank's leading run: deferred allreduces or stage ops,
        each with `seq`, `fingerprint` and `describe()`) every rank has queued;
        raises a mismatch error (every rank's view) when the ranks queued different ones.

        When every rank has the same count (the usual case: the batch is closed by waits at
        the end of a step) one round is the whole check. Otherwise a second round compares the
        full fingerprint of the prefix every rank has.
        """
        t0 = time.perf_counter()
        k = len(candidates)
        first = candidates[0].seq
        n, n_max, lo, hi = read_round(*self._min(round_words(k, batch_fingerprint(candidates)),
                                                 first))
        rounds = 1
        if n != n_max and 1 <= n <= k:
            h = batch_fingerprint(candidates[:n])
            lo, neg = self._min([h, -h], first)
            hi = -neg
            rounds = 2
        dt = time.perf_counter() - t0
        self._stats.record_agreement(dt, rounds)
        if TIMELINE.enabled:
            TIMELINE.complete(tl.AGREE, tl.CAT_AGREE, now_us() - dt * 1e6, dt * 1e6, tid="engine",
                              args={"candidates": k, "rounds": rounds})
        wrong = verdict(k, n, lo, hi)
        if wrong == "range":
            raise self._mismatch(candidates, first + n, None)
        if wrong is not None:
            raise self._mismatch(candidates[:n], first + n, (lo, hi))
        return n

    def _min(self, words: list[int], first_seq: int) -> tuple[int, int]:
        """MIN-allreduce two int64 words on the agreement group (blocking)."""
        vec = torch.tensor(words, dtype=torch.int64)
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.MIN
        work = self._group.allreduce([vec], opts)
        try:
            work.wait()
        except Exception as exc:
            raise EngineError(
                f"gradientflow: rank {self.rank}: agreement round for the fused allreduces from "
                f"sequence number {first_seq} failed (a peer may have died or stopped "
                f"issuing the same collectives): {exc}"
            ) from exc
        return int(vec[0]), int(vec[1])

    def _mismatch(self, ops: list[FusableOp], agreed: int, fps) -> EngineError:
        """Name what differs: every rank's view of the batch, gathered on the side group."""
        mine = [op.describe() for op in ops]
        views = None
        try:
            if fps is None:  # not every rank saw this: a gather could hang
                raise LookupError
            views = self._gather(mine)
        except Exception:  # noqa: BLE001 - the error below is still clear without the views
            pass
        detail = f"fingerprints differ ({fps[0]} vs {fps[1]})" if fps else (
            f"the agreed batch end {agreed} does not fall inside this rank's queued allreduces")
        what = "async allreduces" if not ops or isinstance(ops[0], FusableOp) else (
            "compressed (multi-stage) ops")
        text = (f"gradientflow: rank {self.rank}: collective mismatch in the {what} "
                f"from sequence number {ops[0].seq if ops else '?'}: {detail}. Every rank must "
                "issue the same collectives (op, dtype, shape, reduce op) in the same order; "
                "async allreduces issued from callbacks or threads in timing-dependent order "
                "break that (e.g. powerSGD_hook with several DDP buckets).")
        if views is not None:
            text += "".join(f"\n  rank {r}: {v}" for r, v in enumerate(views))
        return EngineError(text)

    def _gather(self, mine: list[str]) -> list:
        """Every rank's `mine`, gathered on the side group (sizes first, then the padded bytes)."""
        data = torch.frombuffer(bytearray(pickle.dumps(mine)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._group.allgather([sizes], [size]).wait()
        cap = int(max(x.item() for x in sizes))
        padded = torch.zeros(cap, dtype=torch.uint8)
        padded[:data.numel()] = data
        outs = [torch.zeros(cap, dtype=torch.uint8) for _ in range(self.world_size)]
        self._group.allgather([outs], [padded]).wait()
        return [pickle.loads(bytes(o[:int(sz.item())].tolist())) for o, sz in zip(outs, sizes)]
