"""Collective check-ins: mismatch detection, the stall inspector and clear peer-failure errors.

A rank blocked inside a transport call cannot see which rank is missing or what the others
issued instead. So every rank keeps, in memory, a short history of the collectives it issued
(sequence number and a descriptor: op, dtype, shape, root, reduce op; about a microsecond per
call, no communication), and a background thread per process group publishes it to the
group's store as a *check-in* at a low rate (when it changed, at most once per
`inspect_interval_s`; a heartbeat otherwise). Only when this rank's newest collective has been
pending longer than one interval does the thread read the other ranks' check-ins, and then:

- a sequence number whose descriptors differ between two ranks is a *collective mismatch*:
  the group is failed with an error naming both ranks, the sequence number and both
  fingerprints (each rank finds it from the same check-ins, so every rank raises);
- past `stall_warning_s` it logs the ranks that have not issued the pending collective yet
  (Horovod's stall inspector), and past `stall_abort_s` (if set) it fails the group.

A transport error (a peer died, a connection reset) is explained the same way, at the moment
it happens: the failing rank reads the check-ins and names a dead peer or a mismatch.

Before any data moves, every collective is already checked by the engine's rounds
(engine/checks.py): a call the ranks issued differently is refused there on every rank, and
the inspector forgets it (`refuse`). What the rounds cannot see is a mismatch across two of
their streams (a solo allreduce on one rank where another issued a collective of the agreement
stream: each waits in a round the other never joins); the check-ins find it once it stalls
for an interval, compare only what the rounds settled before that (`frontier`), and end the
blocked rounds with the fault.

With `debug` (GRADIENTFLOW_DEBUG=1) every collective, each deferred allreduce included, is
also checked on its own before it is queued: a small allgather of (sequence number,
fingerprint) on a side group, which names the one call that differs inside a fused batch.
"""
from __future__ import annotations

import collections
import datetime
import json
import logging
import os
import socket
import threading
import time
import weakref
from typing import Any, Callable

import torch

from gradientflow.errors import StepFailed
from gradientflow.errors import CollectiveMismatchError, EngineError, PeerFailureError, StallError
from gradientflow.fingerprint import DEFERRED, describe, mix, name_id
from gradientflow.inspector.compare import first_mismatch
from gradientflow.inspector.debug import DebugCheck
from gradientflow.inspector.world import pid_alive
from gradientflow.stores import own_connection

LOG = logging.getLogger("gradientflow")

HISTORY = 64  # collectives remembered in detail per rank (a stall is within a few ops)
MARK_EVERY = 64  # a chain checkpoint every 64 collectives, the last 64 kept: 4096 calls back
_KEY = "gradientflow/checkin/"
_FAULT_KEY = "gradientflow/fault"


class Inspector:
    """Check-ins, mismatch detection and stall inspection for one gradientflow process group."""

    def __init__(self, rank: int, world_size: int, store: Any, timeout_s: float, config: Any,
                 name: str, on_fault: Callable[[BaseException], None],
                 make_group: Callable[[str], Any] | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.name = name
        self.timeout_s = timeout_s
        self.interval = float(config.inspect_interval_s)
        self.stall_warning_s = float(config.stall_warning_s)
        self.stall_abort_s = float(config.stall_abort_s)
        self.slice = datetime.timedelta(seconds=max(self.interval, 0.05))
        self._slice_s = self.slice.total_seconds()
        # Off (inspect_interval_s=0 and no debug): the backend skips the inspector entirely.
        self.enabled = self.interval > 0 or bool(config.debug)
        # Synchronous CPU calls are waited on here in slices (see wait_sync).
        self.sliced = True
        # A connection of its own: a user thread blocked in store.wait() holds the shared
        # client's connection, and the check-ins must go on meanwhile.
        self._store = own_connection(store)
        self._on_fault = on_fault
        self._hist: collections.deque = collections.deque(maxlen=HISTORY)
        # A fingerprint chain over every collective issued: h_n = mix(h_{n-1}, fp(op_n)). Two
        # ranks whose chains differ at a common n issued different collectives at or before n,
        # even long before the detailed history: nothing goes unchecked, only unnamed.
        self._h = 0
        self._n = 0
        self._marks: collections.deque = collections.deque(maxlen=64)
        # Collectives the agreement rounds refused on every rank (their signatures differed,
        # nothing was sent): never compared, and the chains only before the first of them.
        self._seq_n: collections.deque = collections.deque(maxlen=HISTORY * MARK_EVERY)
        self._refused: collections.deque = collections.deque(maxlen=HISTORY)
        self._chain_upto: int | None = None
        # The lowest sequence number the rounds have not settled yet (set by the engine):
        # what is below it was agreed or refused on every rank; above it a round may still be
        # about to refuse a call, so it is compared only once it stalls.
        self.frontier: Callable[[], int] | None = None
        # (seq, name, work, t_issued) of the newest collective: the one a stall shows on.
        self.last: tuple | None = None
        self.fault: BaseException | None = None
        self.warnings: list[str] = []  # stall warnings logged (also for tests and the soak)
        self._warned_seq = -1
        self._compared_n = 0
        self._read_at = 0.0
        self._peer_cache: dict[int, dict] = {}
        self._published = (None, None)
        self._published_at = 0.0
        self._host = socket.gethostname()
        self._stop = threading.Event()
        self._explain_lock = threading.RLock()
        # GRADIENTFLOW_DEBUG: every call checked before the transport (debug.py).
        self.debug: DebugCheck | None = None
        if config.debug and make_group is not None:
            self.debug = DebugCheck(rank, world_size, name, self._store,
                                    make_group("gradientflow/debug/"), self.explain)
        self._thread = None
        if self.interval > 0 and world_size > 1:
            self._thread = threading.Thread(target=_run, args=(weakref.ref(self), self._stop,
                                                               self.interval),
                                            name=f"{name}-inspector", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ hot path
    def record(self, seq: int, name: str, tensor: torch.Tensor | None, root: Any,
               reduce_op: Any, work: Any) -> None:
        """Remember an issued collective (no communication; a microsecond or two).

        Called in sequence order (under the engine's lock), so the chain is the same on every
        rank that issued the same collectives.
        """
        sig, fp = self.signature(name, tensor, root, reduce_op)
        self.record_known(seq, name, sig, fp, root, reduce_op, work)

    @staticmethod
    def signature(name: str, tensor: torch.Tensor | None, root: Any,
                  reduce_op: Any) -> tuple:
        """A call's (signature, hash) as `record` chains them: a caller that repeats a call
        may keep them and record it with `record_known`."""
        # Only ints in the hashed tuple: hash(None) is per-process before Python 3.12.
        r = -1 if root is None else root
        op = -1 if reduce_op is None else hash(reduce_op)  # a ReduceOp hashes to its op number
        if tensor is None:
            return None, hash((name_id(name), r, op))
        sig = (tensor.dtype, tensor.shape)
        return sig, hash((name_id(name), name_id(sig[0]), sig[1], r, op))

    def record_known(self, seq: int, name: str, sig: Any, fp: int, root: Any, reduce_op: Any,
                     work: Any) -> None:
        """`record`, with the call's (signature, hash) from `signature`."""
        self._h = h = mix(self._h, fp)
        self._n = n = self._n + 1
        self._hist.append((seq, n, h, name, sig, root, reduce_op))
        self._seq_n.append((seq, n))
        if n % MARK_EVERY == 0:
            self._marks.append((n, seq, h))
        self.last = (seq, name, work, time.monotonic())

    def refuse(self, seqs: list[int]) -> None:
        """Collectives `seqs` were refused alike on every rank by an agreement round (nothing
        was sent): their records no longer count as a mismatch (engine lock held)."""
        first = min(seqs)
        n = next((n for s_, n in self._seq_n if s_ >= first), self._n + 1)
        self._chain_upto = n if self._chain_upto is None else min(self._chain_upto, n)
        self._refused.extend(seqs)

    def wait_sync(self, work: Any, seq: int, name: str) -> None:
        """Wait on a transport Work of a synchronous call in slices, so a fault found meanwhile
        (mismatch, stall abort) ends the wait with its own error instead of the transport's."""
        while True:
            try:
                work.wait(self.slice)
                return
            except RuntimeError:
                if not work.is_completed():  # one slice elapsed; the operation goes on
                    if self.fault is not None:
                        raise self.fault from None
                    continue
            # Completed, maybe just after the slice ran out: its own outcome.
            try:
                work.wait()
                return
            except RuntimeError as exc:
                raise self.explain(exc, seq, name) from exc

    def attach(self, work: Any, seq: int, name: str) -> Any:
        """Let a FutureWork's wait() end early with this group's fault, and explain the error
        its operation failed with (a fused message completes its Works with the transport's
        raw error, before the engine's explanation is ready). See probe_error."""
        work.inspector = self
        work.slice_s = self._slice_s
        return work

    def probe_error(self, error: BaseException, seq: int, name: str) -> BaseException | None:
        """What a wait on op `seq`, which failed with `error`, should raise instead, if anything:
        the group's first explanation (made once, under a lock) or its fault. A call a round
        refused on every rank raises its own error: the group is fine."""
        if getattr(error, "refused", None):
            return None
        if self.fault is None and not self._stop.is_set():
            return self.explain(error, seq, name)
        return self.fault

    def probe(self) -> BaseException | None:
        return self.fault

    # ------------------------------------------------------------------ check-ins
    def _history(self) -> list:
        return [[seq, n, h, describe(name, sig, root, op)]
                for seq, n, h, name, sig, root, op in list(self._hist)]

    def publish(self, pending: bool, age: float) -> None:
        """Write this rank's check-in to the group's store."""
        last = self.last
        value = {"seq": last[0] if last else -1, "op": last[1] if last else None,
                 "pending": pending, "age": round(age, 3), "t": time.time(),
                 "pid": os.getpid(), "host": self._host, "hist": self._history(),
                 "marks": [list(m) for m in list(self._marks)],
                 "refused": list(self._refused), "chain_upto": self._chain_upto}
        self._store.set(f"{_KEY}{self.rank}", json.dumps(value))
        self._published = (value["seq"], pending)
        self._published_at = time.monotonic()

    def read_peers(self, neighbours_only: bool = False) -> dict[int, dict | None]:
        """The other ranks' latest check-ins (None where a rank never checked in)."""
        out: dict[int, dict | None] = {}
        ranks = range(self.world_size)
        if neighbours_only and self.world_size > 16:  # O(world) store reads per interval
            ranks = [(self.rank + 1) % self.world_size]
        for r in ranks:
            if r == self.rank:
                continue
            key = f"{_KEY}{r}"
            try:
                out[r] = json.loads(self._store.get(key)) if self._store.check([key]) else None
                if out[r] is not None:
                    self._peer_cache[r] = out[r]
            except Exception:  # noqa: BLE001 - a dead store host: the last check-in read
                out[r] = self._peer_cache.get(r)
        return out

    def find_mismatch(self, peers: dict[int, dict | None],
                      settled_only: bool = False) -> CollectiveMismatchError | None:
        """The first sequence number at which another rank issued a different collective.

        `settled_only`: compare only what the rounds settled (below the frontier), since a
        round may be refusing the newer calls right now.
        """
        below = None
        if settled_only and self.frontier is not None:
            try:
                below = self.frontier()
            except Exception:  # noqa: BLE001 - e.g. the engine is closing: compare everything
                below = None
        return first_mismatch(self.rank, self.name, self._history(), list(self._marks), peers,
                              HISTORY, refused=set(self._refused),
                              chain_upto=self._chain_upto, below=below)

    def _missing(self, seq: int, peers: dict[int, dict | None]) -> tuple[list[int], list[str]]:
        """Ranks that have not issued collective `seq` yet, with what is known of each."""
        ranks, notes = [], []
        now = time.time()
        for r, c in sorted(peers.items()):
            if c is None:
                ranks.append(r)
                notes.append(f"rank {r} has not checked in")
            elif c["seq"] < seq:
                ranks.append(r)
                state = "dead" if self._dead(c) else f"last seen {now - c['t']:.1f} s ago"
                notes.append(f"rank {r} is at sequence number {c['seq']} ({c['op']}; {state})")
        return ranks, notes

    def _dead(self, c: dict) -> bool:
        return c.get("host") == self._host and not pid_alive(int(c["pid"]))

    def tick(self) -> None:
        """One pass of the background thread: check in; compare with the peers when this rank
        issued something new (a mismatch that does not hang, e.g. SUM vs MAX, is found here,
        within about two intervals) or while a collective is pending (stall inspection)."""
        if self.fault is not None:
            return
        if self._adopt_announced():
            return
        last = self.last
        now = time.monotonic()
        pending = last is not None and not _completed(last[2])
        age = now - last[3] if pending else 0.0
        state = (last[0] if last else -1, pending)
        if state != self._published or now - self._published_at > 10 * self.interval:
            self.publish(pending, age)
        stalled = pending and age >= self.interval
        # Nothing new since the last comparison: only refresh the peers' pids now and then
        # (what names a dead peer when its store host is gone too).
        if not stalled and self._n == self._compared_n and now - self._read_at < 10 * self.interval:
            return
        peers = self.read_peers(neighbours_only=not stalled)
        self._compared_n = self._n
        self._read_at = now
        err = self.find_mismatch(peers, settled_only=not stalled)
        if err is not None:
            self.set_fault(err)
            return
        if not stalled:
            return
        seq, name = last[0], last[1]
        if self.stall_warning_s > 0 and age >= self.stall_warning_s and self._warned_seq != seq:
            ranks, notes = self._missing(seq, peers)
            msg = (f"gradientflow: rank {self.rank}: {name} (sequence number {seq}) on process "
                   f"group {self.name} has waited {age:.1f} s; ranks {ranks} have not joined it"
                   + (f" ({'; '.join(notes)})" if notes else "") + ".")
            self.warnings.append(msg)
            LOG.warning(msg)
            self._warned_seq = seq
        if self.stall_abort_s > 0 and age >= self.stall_abort_s:
            ranks, notes = self._missing(seq, peers)
            self.set_fault(StallError(
                f"gradientflow: rank {self.rank}: {name} (sequence number {seq}) on process group "
                f"{self.name} stalled for {age:.1f} s (stall_abort_s={self.stall_abort_s:g}); "
                f"ranks {ranks} have not joined it" + (f" ({'; '.join(notes)})" if notes else "")
                + ". The group is aborted: restart from a checkpoint."))

    def _adopt_announced(self) -> bool:
        """If another rank failed the group, fail it here too, with that rank's reason."""
        if not self._store.check([_FAULT_KEY]):
            return False
        src, text = json.loads(self._store.get(_FAULT_KEY))
        cls = CollectiveMismatchError if "mismatch" in text else StallError
        self.set_fault(cls(f"gradientflow: rank {self.rank}: process group {self.name} was "
                           f"failed by rank {src}: {text}"), announce=False)
        return True

    def set_fault(self, err: BaseException, announce: bool = True) -> None:
        """Fail the group with `err` (first fault wins) and tell the other ranks.

        The announcing rank raises only after every live peer acknowledged (or a few
        intervals passed): a rank that raised at once would exit, and with it, if it is rank 0,
        the store the others need to learn what went wrong.
        """
        if self.fault is not None:
            return
        if not announce:  # adopt first, acknowledge after: the announcer raises on our ack
            self._fail_locally(err)
        try:
            if announce:
                text = str(err).split(": ", 2)[-1]
                mine = json.dumps([self.rank, text])
                cur = self._store.compare_set(_FAULT_KEY, "", mine)
                if (cur.decode() if isinstance(cur, bytes) else cur) != mine:
                    # Another rank announced first (it found the same fault): acknowledge.
                    self._store.set(f"{_FAULT_KEY}-ack/{self.rank}", "1")
                else:
                    acks = [f"{_FAULT_KEY}-ack/{r}" for r in range(self.world_size)
                            if r != self.rank]
                    deadline = time.monotonic() + 3 * max(self.interval, 0.1) + 1.0
                    while not self._store.check(acks) and time.monotonic() < deadline:
                        self._stop.wait(0.02)  # peers adopt the fault on their next tick
            else:
                self._store.set(f"{_FAULT_KEY}-ack/{self.rank}", "1")
        except Exception:  # noqa: BLE001 - the store may be gone with a dead rank 0
            pass
        if announce:
            self._fail_locally(err)

    def _fail_locally(self, err: BaseException) -> None:
        self.fault = err
        LOG.error("%s", err)
        try:
            self._on_fault(err)
        except Exception:  # noqa: BLE001 - the fault itself is already recorded
            pass

    def explain(self, exc: BaseException, seq: int, name: str) -> BaseException:
        """Turn a transport error into a sentence: a mismatch, a dead peer, or the raw error.

        A transport error leaves gloo's connections unusable, so the explanation becomes the
        group's fault: every later wait and call raises it, and the engine fails what is
        queued with it. Made once per group (later errors get the first explanation).
        """
        if isinstance(exc, StepFailed):
            return exc  # [algorithms] failed alike on every rank, agreed: not a fault
        return self._explain_once(exc, seq, (
            f"gradientflow: rank {self.rank}: {name} (sequence number {seq}) on process group "
            f"{self.name} failed: {exc}"))

    def explain_engine(self, exc: BaseException) -> BaseException:
        """Engine.explain: the first error of the engine's own work (an agreement round, a fused
        message, a compressed bucket), explained like an eager operation's."""
        text = str(exc)
        if self.fault is None and "collective mismatch" in text:
            return exc  # the agreement round found and named it (every rank's view)
        if not text.startswith("gradientflow: "):
            text = f"gradientflow: rank {self.rank}: process group {self.name} failed: {text}"
        last = self.last
        # The newest collective this rank issued: the ranks that have not reached it are named.
        return self._explain_once(exc, last[0] if last else 0, text)

    def _explain_once(self, exc: BaseException, seq: int, text: str) -> BaseException:
        # Reentrant: the fault's on_fault aborts the engine, whose hook comes back here.
        with self._explain_lock:
            if self.fault is None:
                err = self._explain(exc, seq, text)
                if self.fault is None:  # (else it adopted a fault another rank announced)
                    self._fail_locally(err)
        return self.fault

    def _explain(self, exc: BaseException, seq: int, text: str) -> BaseException:
        store_ok = True
        try:
            if self._adopt_announced():
                return self.fault
            self.publish(True, 0.0)
            deadline = time.monotonic() + min(3 * max(self.interval, 0.1), 5.0)
            while True:
                peers = self.read_peers()
                mm = self.find_mismatch(peers)
                if mm is not None:
                    return mm
                covered = all(c is not None and (c["seq"] >= seq or self._dead(c))
                              for c in peers.values())
                if covered or time.monotonic() > deadline:
                    break
                self._stop.wait(0.05)  # peers publish within one interval; bounded above
        except Exception:  # noqa: BLE001 - the store may be gone with a dead rank 0
            peers = dict(self._peer_cache)
            store_ok = False
            mm = self.find_mismatch(peers)
            if mm is not None:
                return mm
        dead = [r for r, c in sorted(peers.items()) if c is not None and self._dead(c)]
        # gloo aborts a process (no Python error) that receives more bytes than it posted:
        # a size mismatch looks like a death from here. Say how to tell and what to do.
        desc = next((d for s_, _n, _h, d in self._history() if s_ == seq), None)
        hint = "" if desc is None or DEFERRED in desc else (  # (fused: the round checks sizes)
            f" If a dead rank's log ends in gloo's \"Received data size doesn't match expected "
            f"size\", the ranks issued this collective with different sizes (this rank: "
            f"{desc}): GRADIENTFLOW_DEBUG=1 refuses such a call on every rank before the "
            "transport.")
        if dead:
            return PeerFailureError(
                text + f". Rank(s) {dead} died (their processes are gone): restart the job from "
                "a checkpoint (torchrun --max-restarts)." + hint)
        ranks, notes = self._missing(seq, peers)
        if ranks:
            text += f". Ranks {ranks} had not joined it ({'; '.join(notes)})"
        if not store_ok:
            text += (". The store (hosted by the rank that created it, usually rank 0) is "
                     "unreachable too: that rank has most likely failed or exited; see its log.")
            return EngineError(text + hint)
        return EngineError(text + ".")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        if self.debug is not None:
            self.debug.close()


def _completed(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001
        return True


def _run(ref: "weakref.ref[Inspector]", stop: threading.Event, interval: float) -> None:
    # A weak reference: a group nobody destroyed must not be kept alive by its inspector.
    while not stop.wait(interval):
        insp = ref()
        if insp is None:
            return
        try:
            insp.tick()
        except Exception as exc:  # noqa: BLE001 - e.g. the store is gone at teardown
            LOG.debug("gradientflow inspector: %s", exc)
        del insp
