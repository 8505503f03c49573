"""The agreement rounds on the side group: which deferred ops every rank has queued, and
whether every rank issued the same eager collective.

Runs on the engine thread, and on a caller's thread for an eager collective issued while the
engine is idle (the caller then holds the queue's floor, so rounds never overlap). The words
and their reading are pure (agreement.py, checks.py); this module sends them, and when the
ranks disagree, gathers every rank's view for the error.

Every round carries at least one op, so every rank reads the same words and reaches the same
verdict: a mismatch refuses the same ops on every rank, before any of their data moved, and
the group stays usable (`CollectiveMismatchError.refused`).

A round's frame has room for a small allreduce's tensor (checks.INBAND). When the last two
rounds each agreed an exchanged allreduce (checks.EXCHANGE) of the same size, the next round's
frames have room for that size: a program that repeats the call has its tensor carried in the
call's own round, one exchange instead of a round and then the data. A broadcast of up to
checks.CARRY_BYTES agreed within the last CARRY_ROUNDS rounds keeps room for its size too: a
program that broadcasts the same buffers every step (DDP's) has them carried from the second
step on. The room is a function of what earlier rounds agreed, so every rank sends frames of
one size whatever it now holds; a call that differs is refused as in any round, before its
payload is read.
"""
from __future__ import annotations

import datetime
import pickle
import threading
import time
from typing import Any, Callable

import torch
from torch._C._distributed_c10d import ReduceOp

from gradientflow.engine.agreement import batch_fingerprint, read_round, round_words, verdict
from gradientflow.engine.checks import (CARRIED, EXCHANGE, Check, inband_cap, pair_word,
                                        pairs_agree)
from gradientflow.engine.exchange import Exchange
from gradientflow.engine.fusion import FusableOp
from gradientflow.errors import CollectiveMismatchError, EngineError
from gradientflow.fingerprint import mix
from gradientflow.observability import timeline as tl
from gradientflow.observability.timeline import TIMELINE, now_us

_SLICE = datetime.timedelta(seconds=0.2)  # how often a blocked round looks for a fault
# How long the room of an agreed broadcast lasts, in rounds: a training step's rounds (a batch
# or a few per step, a compressed bucket's stages) lie well inside it.
CARRY_ROUNDS = 64


class Rounds:
    """Agreement rounds of one process group, on its side group `group` (never the data's)."""

    def __init__(self, rank: int, world_size: int, group: Any, stats: Any,
                 name: str = "gradientflow", payloads: bool = True) -> None:
        self.rank = rank
        self.world_size = world_size
        self._group = group
        self._stats = stats
        self._name = name
        # The group's fault, if any (the inspector's: a mismatch across the agreement and solo
        # streams, a stall abort): a round blocked on a rank that will never join ends with it.
        self.fault: Callable[[], BaseException | None] = lambda: None
        self._ex: Exchange | None = None
        # Whether a round can carry a call's tensor (checks.own_route): every frame of the
        # group is then that much larger; the solo channel's rounds carry none.
        self._payload_cap = inband_cap(world_size) if payloads else 0
        # Bytes of the exchanged allreduce each of the last two rounds agreed (0: a round of
        # another kind, or one that failed): the same on every rank (_cap).
        self._recent = (0, 0)
        # The largest broadcast size (above the in-band room) agreed lately, and the last
        # round its room lasts to; rounds are numbered alike on every rank (`_round_no`).
        self._round_no = 0
        self._carry = (0, -1)
        # Every rank's payload of this thread's last round (exchange.py), per thread: the
        # engine thread and a caller's thread each read their own round's.
        self._last = threading.local()

    def agree(self, candidates: list, waited: bool = False) -> int:
        """How many of `candidates` (this rank's leading run: deferred allreduces or stage ops,
        or one eager collective's Check; each with `seq`, `fingerprint` and `describe()`)
        every rank has queued; raises CollectiveMismatchError (every rank's view) when the
        ranks queued different ones.

        `waited`: this rank's caller is blocked on these candidates (the round's third word,
        MIN-reduced). When it is so on every rank, a mismatch refuses them alike on every rank
        (`CollectiveMismatchError.refused`, the count refused) and the group goes on: every
        caller gets the error at once. Otherwise the error fails the group, since a rank whose
        later calls were issued from callbacks would wait on peers that stopped at the error.

        When every rank has the same count (the usual case: the batch is closed by waits at
        the end of a step) one round is the whole check. Otherwise a second round compares the
        full fingerprint of the prefix every rank has.

        A lone candidate's `payload`, if the round has room for it (_cap), travels in the round
        (this thread's `_last.rode` says whether it did; check adds the peers').
        """
        try:
            n = self._agree(candidates, waited)
        except BaseException:
            self._advance(0)
            raise
        one = candidates[0]
        route = one.route if n == 1 and isinstance(one, Check) else 0
        if route == CARRIED:
            self._keep_room(_nbytes(one.payload))
        self._advance(_nbytes(one.payload) if route == EXCHANGE else 0)
        return n

    def _advance(self, exchanged: int) -> None:
        """One more round in the history the room follows (_cap): `exchanged`, the bytes of
        the exchanged allreduce it agreed (0: a round of another kind, or one that failed)."""
        self._recent = (self._recent[1], exchanged)
        self._round_no += 1

    def _keep_room(self, nbytes: int) -> None:
        """Keep room for a broadcast of `nbytes` for the next CARRY_ROUNDS rounds (the
        largest such size while it lasts; a smaller one's room comes back when it recurs)."""
        size, until = self._carry
        if nbytes > self._payload_cap and (nbytes >= size or until < self._round_no):
            self._carry = (nbytes, self._round_no + CARRY_ROUNDS)

    def _cap(self) -> int:
        """The payload room of this round's frames: the in-band size, or the size of the
        exchanged allreduce that each of the last two rounds agreed, when they agreed the same,
        or a broadcast's kept room, whichever is larger (module doc). The same on every rank:
        it follows what the rounds agreed."""
        base = self._payload_cap
        if not base:
            return 0
        a, b = self._recent
        room = b if a == b > base else base
        size, until = self._carry
        return size if size > room and until >= self._round_no else room

    def _agree(self, candidates: list, waited: bool) -> int:
        t0 = time.perf_counter()
        k = len(candidates)
        first = candidates[0].seq
        payload = getattr(candidates[0], "payload", None) if k == 1 else None
        cap = self._cap()
        if payload is not None and _nbytes(payload) > cap:
            payload = None  # no room this round: the data goes after it
        self._last.rode = payload is not None
        if payload is not None and candidates[0].route == CARRIED:
            # A broadcast: the root's tensor rides; the others' frames carry none.
            payload = payload.contiguous() if candidates[0].key[3] == self.rank else None
        words = round_words(k, batch_fingerprint(candidates)) + [int(waited)]
        every = self._swap(words, first, payload, cap)
        return self._judge(candidates, words, every, waited, t0)

    def _judge(self, candidates: list, words: list[int], every: list[list[int]],
               waited: bool, t0: float) -> int:
        """What a round whose words every rank sent (`every`) agreed (agree); raises on a
        mismatch. `t0`: when the round began, for the statistics."""
        k = len(candidates)
        first = candidates[0].seq
        if all(w == words for w in every):  # the usual round: every rank queued the same
            n, n_max, lo, hi, all_waited = k, k, 0, 0, waited
        else:
            a, b, all_waited = self._fold(every, ReduceOp.MIN, first)
            n, n_max, lo, hi = read_round(a, b)
        rounds = 1
        if n != n_max and 1 <= n <= k:
            h = batch_fingerprint(candidates[:n])
            lo, neg = self._min([h, -h], first)
            hi = -neg
            rounds = 2
        # eager or solo calls' signatures, or a batch's agreement
        self._record(isinstance(getattr(candidates[0], "check", candidates[0]), Check), t0, k,
                     rounds)
        wrong = verdict(k, n, lo, hi)
        if wrong == "range":
            raise self._mismatch(candidates, first + n, None)
        if wrong is not None:
            raise self._mismatch(candidates[:n], first + n, (lo, hi), bool(all_waited))
        return n

    def _record(self, check: bool, t0: float, k: int, rounds: int) -> None:
        """A round begun at `t0`, of `k` candidates in `rounds` rounds, in the statistics
        (`check`: an eager or solo call's signature round) and the timeline."""
        dt = time.perf_counter() - t0
        if check:
            self._stats.record_check(dt)
        else:
            self._stats.record_agreement(dt, rounds)
        if TIMELINE.enabled:
            TIMELINE.complete(tl.AGREE, tl.CAT_AGREE, now_us() - dt * 1e6, dt * 1e6, tid="engine",
                              args={"candidates": k, "rounds": rounds})

    def own(self, chk: Check) -> None:
        """`check` of a synchronous allreduce on a route of its own (sync_own.py; a lone Check
        with a payload and no pairs, its caller waiting), as one function: a repeated call
        pays for its round little more than the exchange. A round whose words differ is judged
        as `agree` judges any (_judge), so the outcome is agree's."""
        t0 = time.perf_counter()
        payload = chk.payload
        nbytes = _nbytes(payload)
        cap = self._cap()
        rode = nbytes <= cap
        self._last.rode = rode
        words = round_words(1, mix(chk.seq, chk.fingerprint)) + [1]  # batch_fingerprint([chk])
        try:
            every = self._swap(words, chk.seq, payload if rode else None, cap)
            if any(w != words for w in every):
                self._judge([chk], words, every, True, t0)
            else:
                self._record(True, t0, 1, 1)
        except BaseException:
            self._advance(0)
            raise
        self._advance(nbytes if chk.route == EXCHANGE else 0)
        chk.summed = rode
        if rode:
            self._add_payloads(payload)

    def check(self, chk: Check, waited: bool = True) -> None:
        """The round of one eager collective (and, for all-to-all, its pair round); raises
        CollectiveMismatchError on every rank, before any data moved, if the ranks differ
        (`waited`: as in agree). Sets `chk.summed` when the call's payload travelled in the
        round and the peers' were added to it: nothing of the call is left to send."""
        self.agree([chk], waited)
        chk.summed = self._last.rode
        if chk.summed:
            if chk.route == CARRIED:
                self._copy_root(chk.payload, chk.key[3])
            else:
                self._add_payloads(chk.payload)
        if chk.pairs is None:
            return
        send, recv = chk.pairs()
        total = self._reduce([pair_word(self.rank, send, recv)], ReduceOp.SUM, chk.seq)[0]
        if not pairs_agree(total):
            raise self._pairs_mismatch(chk, send, recv)

    def _add_payloads(self, tensor: torch.Tensor) -> None:
        """An in-band allreduce's result: the other ranks' tensors, from the round just agreed,
        added to this rank's (checks.own_route says when the order cannot matter)."""
        ex = self._exchange()
        nbytes = tensor.numel() * tensor.element_size()
        for r, size in enumerate(self._last.payloads):
            if r != self.rank and size >= 0:
                if size != nbytes:  # the round agreed dtype and shape: a frame not ours
                    raise EngineError(
                        f"gradientflow: rank {self.rank}: rank {r} sent {size} payload bytes "
                        f"in the round of an allreduce of {nbytes} bytes")
                tensor.add_(ex.payload_of(r, tensor))

    def _copy_root(self, tensor: torch.Tensor, root: int) -> None:
        """A carried broadcast's result: the root's tensor, from the round just agreed."""
        if root == self.rank:
            return
        nbytes = tensor.numel() * tensor.element_size()
        size = self._last.payloads[root]
        if size != nbytes:  # the round agreed dtype, shape and root: a frame not ours
            raise EngineError(
                f"gradientflow: rank {self.rank}: rank {root} sent {size} payload bytes in "
                f"the round of a broadcast of {nbytes} bytes from it")
        tensor.copy_(self._exchange().payload_of(root, tensor))

    def _min(self, words: list[int], first_seq: int) -> tuple[int, int]:
        """MIN-allreduce two int64 words on the agreement group (blocking)."""
        vec = self._reduce(words, ReduceOp.MIN, first_seq)
        return vec[0], vec[1]

    def _reduce(self, words: list[int], op: Any, first_seq: int,
                payload: torch.Tensor | None = None) -> list[int]:
        """Every rank's int64 words reduced with `op` (MIN or SUM), the same on every rank;
        blocks, ending early on a fault. `payload`: sent beside the words (this thread's
        `_last.payloads` then holds every rank's payload size, by rank: _add_payloads).

        One message to every other rank and one from each (exchange.py), reduced here: one
        hop, where gloo's ring allreduce takes 2(n-1) hops in a row, and a peer that sent
        another kind of round is read and named instead of aborting the transport.
        """
        return self._fold(self._swap(words, first_seq, payload), op, first_seq)

    def _swap(self, words: list[int], first_seq: int, payload: torch.Tensor | None = None,
              cap: int | None = None) -> list[list[int]]:
        """Every rank's words of one round, by rank (_reduce); `cap`: this round's room
        (_cap), if the caller has it."""
        try:
            every, self._last.payloads = self._exchange().swap(
                words, payload, self._cap() if cap is None else cap)
        except CollectiveMismatchError:
            raise
        except Exception as exc:
            raise EngineError(
                f"gradientflow: rank {self.rank}: agreement round for the collectives from "
                f"sequence number {first_seq} failed (a peer may have died or stopped "
                f"issuing the same collectives): {exc}"
            ) from exc
        return every

    def _fold(self, every: list[list[int]], op: Any, first_seq: int) -> list[int]:
        """Every rank's words (_swap) reduced with `op`, column by column (_reduce)."""
        k = len(every[self.rank])
        odd = [r for r, w in enumerate(every) if len(w) != k]
        if odd:
            raise EngineError(
                f"gradientflow: rank {self.rank}: agreement round for the collectives from "
                f"sequence number {first_seq}: rank {odd[0]} sent a round of "
                f"{len(every[odd[0]])} words where this rank sent {k}: the ranks issued "
                "different collectives (GRADIENTFLOW_DEBUG=1 names them)")
        if op == ReduceOp.SUM:
            return [sum(col) for col in zip(*every)]
        return [min(col) for col in zip(*every)]

    def _exchange(self) -> Exchange:
        """The point-to-point rounds of the side group (made at the first round)."""
        if self._ex is None:
            self._ex = Exchange(self._group, self.rank, self.world_size,
                                self._payload_cap, self.wait)
        return self._ex

    def wait(self, work: Any) -> None:
        """Wait for a round's Work (or another transport Work) in slices, raising the group's
        fault if one is found."""
        while True:
            try:
                work.wait(_SLICE)
                return
            except RuntimeError:
                if work.is_completed():
                    # It may have completed just after the slice ran out: its own outcome.
                    work.wait()
                    return
                fault = self.fault()
                if fault is not None:
                    raise fault from None

    def _views(self, mine: list[str]) -> list | None:
        try:
            return self._gather(mine)
        except Exception:  # noqa: BLE001 - the error is still clear without the views
            return None

    def _mismatch(self, ops: list, agreed: int, fps,
                  refusable: bool = False) -> CollectiveMismatchError:
        """Name what differs: every rank's view of the batch, gathered on the side group.

        With `fps` every rank read the same words; `refusable` (every caller waits on these
        ops): every rank refuses the same `len(ops)` ops and the group stays usable. Else the
        error fails the group (so also without `fps`: a batch end outside this rank's
        candidates, which the rounds' words rule out).
        """
        mine = [op.describe() for op in ops]
        views = self._views(mine) if fps is not None else None  # (else a gather could hang)
        fault = self.fault() if views is None else None
        if isinstance(fault, CollectiveMismatchError):
            # The inspector found the same mismatch first and failed the group (which ended
            # the gather): its error names every rank's call.
            return fault
        if ops and isinstance(ops[0], Check) and views is not None:
            err = self._eager_mismatch(ops[0], views)
        else:
            detail = f"fingerprints differ ({fps[0]} vs {fps[1]})" if fps else (
                f"the agreed batch end {agreed} does not fall inside this rank's queued "
                "allreduces")
            what = "async allreduces" if not ops or isinstance(ops[0], FusableOp) else (
                "compressed (multi-stage) ops")
            text = (f"gradientflow: rank {self.rank}: collective mismatch in the {what} "
                    f"from sequence number {ops[0].seq if ops else '?'}: {detail}. Every rank "
                    "must issue the same collectives (op, dtype, shape, reduce op) in the same "
                    "order; async allreduces issued from callbacks or threads in "
                    "timing-dependent order break that (e.g. powerSGD_hook with several DDP "
                    "buckets).")
            if views is not None:
                text += "".join(f"\n  rank {r}: {v}" for r, v in enumerate(views))
            if fps is not None:
                text += ("\nThey were refused on every rank before any data moved" + (
                    "." if refusable else "; since not every rank was waiting on them, "
                    "the group is failed."))
            err = CollectiveMismatchError(text)
        err.refused = len(ops) if fps is not None and refusable else None
        return err

    def _eager_mismatch(self, chk: Check, views: list) -> CollectiveMismatchError:
        """The error of an eager collective that another rank issued differently."""
        from gradientflow.fingerprint import text_fingerprint

        mine = views[self.rank]
        other = next((r for r, v in enumerate(views) if v != mine), self.rank)

        def said(r: int) -> str:
            v = views[r]
            text = "; ".join(s.split(" ", 1)[1] if s.startswith("#") else s for s in v)
            if len(v) > 1:
                text = f"async allreduces: {text}"
            return f"{text} [fingerprint {text_fingerprint(text)}]"

        return CollectiveMismatchError(
            f"gradientflow: rank {self.rank}: collective mismatch at sequence number "
            f"{chk.seq} on process group {self._name}: rank {self.rank} issued "
            f"{said(self.rank)}, rank {other} issued {said(other)}. Every rank must issue the "
            "same collectives (op, dtype, every dimension, root, reduce op) in the same "
            "order; the call was refused on every rank before any data moved."
            + "".join(f"\n  rank {r}: {'; '.join(v)}" for r, v in enumerate(views)))

    def _pairs_mismatch(self, chk: Check, send: list, recv: list) -> CollectiveMismatchError:
        """All-to-all sizes that do not pair up: name the pairs (gathered on the side group)."""
        w = self.world_size
        views = self._views([list(map(int, send)), list(map(int, recv))])
        bad = []
        if views is not None:
            bad = [(i, j, views[i][0][j], views[j][1][i]) for i in range(w) for j in range(w)
                   if views[i][0][j] != views[j][1][i]]
        pairs = "; ".join(f"rank {i} sends {sb} bytes to rank {j}, which expects {rb}"
                          for i, j, sb, rb in bad[:8]) or "the sizes do not pair up"
        err = CollectiveMismatchError(
            f"gradientflow: rank {self.rank}: collective mismatch at sequence number "
            f"{chk.seq} on process group {self._name}: {describe_op(chk)} sizes disagree "
            f"between ranks: {pairs}{' ...' if len(bad) > 8 else ''}. Make each rank's input "
            "split sizes match the output split sizes of the ranks it sends to; the call was "
            "refused on every rank before any data moved.")
        err.refused = 1
        return err

    def _gather(self, mine: list[str]) -> list:
        """Every rank's `mine`, gathered on the side group (sizes first, then the padded bytes)."""
        data = torch.frombuffer(bytearray(pickle.dumps(mine)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self.wait(self._group.allgather([sizes], [size]))
        cap = int(max(x.item() for x in sizes))
        padded = torch.zeros(cap, dtype=torch.uint8)
        padded[:data.numel()] = data
        outs = [torch.zeros(cap, dtype=torch.uint8) for _ in range(self.world_size)]
        self.wait(self._group.allgather([outs], [padded]))
        return [pickle.loads(bytes(o[:int(sz.item())].tolist())) for o, sz in zip(outs, sizes)]


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def describe_op(chk: Check) -> str:
    """The op of a Check, as named in errors."""
    return chk.key[0]
