"""reduction_server: the workers' side of Google's Reduction Server.

R stateless reducer processes (python -m gradientflow.reducer) serve the job. A message of
|D| bytes is cut into R shards; each worker sends shard j once to reducer j and receives it
back summed: |D| each way per worker, against ring's 2(n-1)/n |D|. Reducer j sums the n
workers' shards in worker rank order ((x_0 + x_1) + x_2) + ..., in the message's dtype: the
same sum on every worker, equal to ring's up to float rounding.

Transport: one gloo group per (channel, reducer, generation) holding the n workers (ranks
0..n-1, their group ranks) and the reducer (rank n), met through the job's own store (the
root of the process group's store, under `gradientflow/rs/`); point-to-point send/recv on it,
no sockets of our own. Each shard travels in pieces so a reducer's reply to one piece
overlaps the workers' upload of the next (full duplex: about |D| / bandwidth per message
instead of 2 |D| / bandwidth). A worker sends its first piece to every reducer at once, so a
message's pipeline fills and drains in R pieces: a piece is ROUND_BYTES / R (at least
MIN_PIECE_BYTES), which keeps that at about ROUND_BYTES / bandwidth per message whatever R.

Failure and restart (docs/ALGORITHMS.md): a reducer claims a fresh generation G (a counter in
the store) every time it starts serving a channel, and publishes `up{G}`. Workers wait for it
up to the group timeout, agree on the generation to use (MAX over workers), and connect. After
every message the workers agree, on a workers-only gloo group, whether every reducer answered;
if one did not (it died, or hung past the timeout), the message fails on every worker with
StepFailed naming it, its group is dropped, and the next message waits for a generation above
the failed one: a restarted reducer is taken back then, a missing one fails that message too.
"""
from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import torch
from torch._C._distributed_c10d import (AllreduceOptions, PrefixStore, ProcessGroupGloo,
                                        ReduceOp)

from gradientflow import algorithm_registry as registry
from gradientflow.algorithms.base import StepFailed, record_bytes

NAME = "reduction_server"
NAMESPACE = "gradientflow/rs/"
ROUND_BYTES = 2**20  # one piece to every reducer: what a message's pipeline fill costs
MIN_PIECE_BYTES = 2**16  # below this, per-piece costs (a gloo op, a reducer wake-up) dominate
WAIT_FRACTION = 0.75  # of the group timeout: waits for reducers end before the callers' waits
MAGIC = 0x6766_7273  # "gfrs"
HEADER = 6  # int64: magic, message number, shard numel, dtype code, op code, chunk numel
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
          torch.int8, torch.uint8)
OPS = {ReduceOp.SUM: 0, ReduceOp.PRODUCT: 1, ReduceOp.MIN: 2, ReduceOp.MAX: 3}


def root_store(store):
    """The job's store under every PrefixStore (the one reducers reach through
    MASTER_ADDR/MASTER_PORT or torchrun's endpoint)."""
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    return store


def own_client(store, timeout_s: float):
    """A client connection of our own to the job's TCPStore: a wait for a reducer must not
    hold the connection the group's inspector checks in through (other stores: shared)."""
    from torch.distributed import TCPStore

    if isinstance(store, TCPStore):
        return TCPStore(store.host, store.port, is_master=False, wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=timeout_s))
    return store


def op_code(opts: Any) -> int | None:
    """The wire code of the options' reduce op, or None when reducers cannot do it."""
    op = opts.reduceOp
    for k, v in OPS.items():
        if op == k:
            return v
    return None


def supports(tensor: torch.Tensor, opts: Any) -> bool:
    """Whether reducers can allreduce this message (CPU, a known dtype and reduce op)."""
    return tensor.device.type == "cpu" and tensor.dtype in DTYPES and op_code(opts) is not None


def shard_bounds(numel: int, reducers: int) -> list[tuple[int, int]]:
    """[start, end) of each reducer's shard: as even as possible, in reducer order."""
    base, extra = divmod(numel, reducers)
    out, at = [], 0
    for j in range(reducers):
        n = base + (1 if j < extra else 0)
        out.append((at, at + n))
        at += n
    return out


def piece_bytes(reducers: int) -> int:
    """Bytes of one piece of a shard with `reducers` reducers (module doc)."""
    return max(MIN_PIECE_BYTES, ROUND_BYTES // max(1, reducers))


def chunk_bounds(numel: int, chunk: int) -> list[tuple[int, int]]:
    return [(a, min(numel, a + chunk)) for a in range(0, numel, chunk)] or []


def traffic(nbytes: int, reducers: int, numel: int) -> tuple[float, ...]:
    """(sent, received, inter-host sent, inter-host received): the message each way, plus a
    header per reducer with a non-empty shard (reducers run on other machines)."""
    used = sum(1 for a, b in shard_bounds(numel, reducers) if b > a)
    sent = nbytes + used * HEADER * 8
    return (sent, nbytes, sent, nbytes)


class _Reducer:
    """The workers' view of reducer j on one channel: its generation and group."""

    def __init__(self) -> None:
        self.min_gen = 1  # the next group must be of at least this generation
        self.gen = 0
        self.group: Any = None


class ReductionServerChannel:
    """reduction_server for one channel of one process group (workers' side)."""

    def __init__(self, store, rank: int, size: int, reducers: int, timeout_s: float,
                 channel: str, group_label: str) -> None:
        self.rank = rank
        self.size = size
        self.R = reducers
        self.timeout_s = timeout_s
        self.channel = channel
        self.label = group_label
        self._store = PrefixStore(NAMESPACE, own_client(root_store(store), timeout_s))
        self._ns = f"{channel}/"
        self._status: Any = None
        self._reducers = [_Reducer() for _ in range(reducers)]
        self._dropped: list[Any] = []  # groups of failed generations, never destroyed mid-use
        self._msg = 0
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- setup
    def _timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    def _budget(self) -> datetime.timedelta:
        """How long a wait for a reducer may take: 3/4 of the group timeout, so that the
        agreed failure reaches every caller's wait() before that wait's own timeout."""
        return datetime.timedelta(seconds=WAIT_FRACTION * self.timeout_s)

    def _ensure_status(self) -> None:
        if self._status is not None:
            return
        if self.rank == 0:
            i = self._store.add("nchannels", 1) - 1
            self._store.set(f"channel/{i}", f"{self.channel}|{self.size}|{self.timeout_s}")
        self._status = ProcessGroupGloo(PrefixStore(f"{self._ns}status/", self._store),
                                        self.rank, self.size, self._timeout())

    def _agree(self, words: list[int]) -> list[int]:
        """MIN over the workers of `words` (the workers-only group)."""
        vec = torch.tensor(words, dtype=torch.int64)
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.MIN
        self._status.allreduce([vec], opts).wait()
        return vec.tolist()

    def _connect(self, needed: list[int]) -> None:
        """Join the reducers in `needed` (agreed generations); StepFailed names the missing."""
        ok, gens = [], []
        for j in needed:
            r = self._reducers[j]
            try:
                self._store.wait([f"{self._ns}r{j}/up{r.min_gen}"], self._budget())
                ok.append(1)
                gens.append(self._store.add(f"{self._ns}r{j}/gen", 0))
            except Exception:  # noqa: BLE001 - a timeout: this reducer is missing
                ok.append(0)
                gens.append(0)
        agreed = self._agree(ok + [-g for g in gens])
        missing = [j for j, v in zip(needed, agreed[:len(needed)]) if not v]
        if missing:
            raise StepFailed(
                f"gradientflow: rank {self.rank}: reduction_server on process group "
                f"{self.label}: reducer(s) {missing} of {self.R} did not join within "
                f"{WAIT_FRACTION * self.timeout_s:.1f} s (channel {self.channel}): "
                "start them with `python -m "
                f"gradientflow.reducer --workers {self.size} --reducers {self.R}` against this "
                "job's store (MASTER_ADDR/MASTER_PORT or torchrun's --rdzv-endpoint), or use "
                "algorithm=ring")
        failed = []
        for j, neg in zip(needed, agreed[len(needed):]):
            r = self._reducers[j]
            r.gen = -neg
            try:
                r.group = ProcessGroupGloo(
                    PrefixStore(f"{self._ns}r{j}/g{r.gen}/", self._store), self.rank,
                    self.size + 1, self._timeout())
                failed.append(1)
            except Exception:  # noqa: BLE001 - it died between publishing and connecting
                r.group = None
                failed.append(0)
        agreed = self._agree(failed)
        lost = [j for j, v in zip(needed, agreed) if not v]
        if lost:
            for j in needed:
                self._drop(j)
            raise StepFailed(
                f"gradientflow: rank {self.rank}: reduction_server on process group "
                f"{self.label}: could not connect to reducer(s) {lost} of {self.R} within "
                f"{self.timeout_s:.0f} s (channel {self.channel}); restart them")

    def _drop(self, j: int) -> None:
        r = self._reducers[j]
        if r.group is not None:
            self._dropped.append(r.group)
            try:  # closes its connections: a reducer blocked on it moves to a new generation
                r.group.abort()
            except Exception:  # noqa: BLE001
                pass
        r.group = None
        r.min_gen = max(r.min_gen, r.gen + 1)

    # ---------------------------------------------------------------- one message
    def allreduce_blocking(self, tensor: torch.Tensor, opts: Any) -> list:
        """Allreduce `tensor` in place through the reducers (on the channel's executor)."""
        with self._lock:
            return self._allreduce(tensor, opts)

    def _allreduce(self, tensor: torch.Tensor, opts: Any) -> list:
        self._ensure_status()
        flat = tensor.view(-1)
        numel = flat.numel()
        shards = shard_bounds(numel, self.R)
        used = [j for j, (a, b) in enumerate(shards) if b > a]
        needed = [j for j in used if self._reducers[j].group is None]
        if needed:
            self._connect(needed)
        self._msg += 1
        nbytes = numel * tensor.element_size()
        record_bytes(NAME, nbytes, *traffic(nbytes, self.R, numel))
        chunk = max(1, piece_bytes(self.R) // tensor.element_size())
        code = DTYPES.index(tensor.dtype)
        op = op_code(opts)
        sends: list[tuple[int, Any]] = []
        recvs: list[tuple[int, Any]] = []
        errors: dict[int, str] = {}
        n = self.size
        pieces = {}
        for j in used:
            a, b = shards[j]
            header = torch.tensor([MAGIC, self._msg, b - a, code, op, chunk], dtype=torch.int64)
            pieces[j] = chunk_bounds(b - a, chunk)
            try:
                sends.append((j, self._reducers[j].group.send([header], n, 0)))
            except Exception as exc:  # noqa: BLE001
                errors.setdefault(j, str(exc))
        # Interleave the reducers' pieces so every reducer's link starts at once.
        for c in range(max((len(p) for p in pieces.values()), default=0)):
            for j in used:
                if j in errors or c >= len(pieces[j]):
                    continue
                a = shards[j][0] + pieces[j][c][0]
                b = shards[j][0] + pieces[j][c][1]
                g = self._reducers[j].group
                try:
                    sends.append((j, g.send([flat[a:b]], n, 1 + c)))
                    recvs.append((j, g.recv([flat[a:b]], n, 1 + c)))
                except Exception as exc:  # noqa: BLE001
                    errors.setdefault(j, str(exc))
        deadline = time.monotonic() + WAIT_FRACTION * self.timeout_s
        for j, w in sends + recvs:
            if j in errors:
                continue
            left = max(0.001, deadline - time.monotonic())
            try:
                w.wait(datetime.timedelta(seconds=left))
            except Exception as exc:  # noqa: BLE001 - died or hung: agreed below
                errors.setdefault(j, str(exc))
        agreed = self._agree([0 if j in errors else 1 for j in range(self.R)])
        bad = [j for j in range(self.R) if not agreed[j]]
        if bad:
            for j in bad:
                self._drop(j)
            why = "; ".join(f"reducer {j}: {errors[j]}" for j in bad if j in errors)
            raise StepFailed(
                f"gradientflow: rank {self.rank}: reduction_server on process group "
                f"{self.label}: reducer(s) {bad} of {self.R} failed during the allreduce of a "
                f"{nbytes}-byte message (channel {self.channel}); it failed on every worker"
                f"{' (' + why + ')' if why else ' (seen by another worker)'}. A restarted "
                "reducer (python -m gradientflow.reducer ... --index J) is taken back at the "
                "next message")
        return [tensor]

    def shutdown(self) -> None:
        pass  # groups are left to the process's exit: a gloo group in use must not be freed


class ReductionServerHandler:
    """A channel's reduction_server: its reducer connections, made at the first message."""

    def __init__(self, channel: Any) -> None:
        a = channel.algos
        self._channel = channel
        self._server = ReductionServerChannel(a.store, a.rank, a.size, a.reducers, a.timeout_s,
                                              f"{a.label}.{channel.name}", a.label)

    def allreduce(self, device: torch.device, tensors: list, opts: Any) -> Any:
        t = tensors[0]
        with self._channel.lock:
            return self._channel.executor().submit(
                lambda: self._server.allreduce_blocking(t, opts))


ALGORITHM = registry.attach(NAME, build=ReductionServerHandler, carries=supports)
