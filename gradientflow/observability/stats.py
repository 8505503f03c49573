"""The one statistics sink: what the engine, the compression layer and waits did.

Every count gradientflow keeps reports here: the engine of each process group through its
`GroupStats` (its own counters, also added to the process totals), the compression layer
through `STATS.record_chunks` / `record_bytes`, and Work.wait() through `record_wait`.
`gradientflow.stats()` reads the process totals.

Leaf module: imports nothing of gradientflow (stdlib only). Every `record_*` call takes one
uncontended lock (well under a microsecond), so the counters are exact under any number of
threads; they are always on.

Definitions (one set, used by `gradientflow.stats()` and the experiments):

* ``operations``: collective operations submitted to the engine (one per user/bucket op).
* ``fused_operations``: transport messages the engine issued for those operations: each
  collective on the wire counts once, so a compressed bucket's chunk-norm allreduce and its
  packed-chunk allreduce count as two; ``tensors_fused``: tensors packed into those messages.
* ``wire_bytes``: every byte this rank hands to the transport for gradients, including chunk-norm
  vectors and tensors sent dense (the compression issue's definition); counted as message
  payload size, not multiplied by the ring algorithm's 2(n-1)/n, which is the same for every
  message and cancels in the ratio. ``dense_bytes``: the same gradients as dense FP32
  (4 bytes x numel). ``compression_ratio`` = dense_bytes / wire_bytes.
* ``chunks_sent`` / ``chunks_total``: CSC chunks selected and available; ``density`` their ratio.
* ``comm_time_s``: engine time in transport collectives; ``agreement_time_s``: engine time in
  agreement rounds (``agreement_rounds`` of them); ``codec_time_s``: compress + decompress.
  ``busy_time_s`` = comm + agreement + codec: the time the engine spends on user gradients' data.
* ``exposed_wait_s``: time user threads spent blocked in ``Work.wait()`` (or a future's wait) on
  engine operations: the part of communication that computation did not hide.
* ``overlap_fraction`` = 1 - exposed_wait_s / busy_time_s, clamped to [0, 1]: the fraction of
  the engine's communication work hidden under computation (1: fully hidden; 0: the user waited
  for all of it). None before any communication. Waits that include queueing behind other
  operations can exceed the busy time; the clamp then reports 0.
* ``steps``: steps marked with `record_step` (per-step averages divide by it).
"""
from __future__ import annotations

import threading
import time

__all__ = ["GroupStats", "Stats", "STATS", "stats", "reset_stats"]

_COUNTERS = (
    "operations", "fused_operations", "tensors_fused", "wire_bytes", "dense_bytes",
    "chunks_sent", "chunks_total", "comm_time_s", "agreement_rounds", "agreement_time_s",
    "codec_time_s", "exposed_wait_s", "waits", "steps",
)


# Per collective algorithm (ring, hierarchical, reduction_server): what this rank hands to and
# takes from the network for gradient messages, as the algorithm's own protocol defines it.
ALGORITHM_FIELDS = ("messages", "bytes", "sent_bytes", "recv_bytes", "inter_host_sent_bytes",
                    "inter_host_recv_bytes")


class Stats:
    """Thread-safe engine counters with a `snapshot()` of derived values and `reset()`.

    Example::

        STATS.record_message(tensors=12, wire_bytes=2_000_000, dense_bytes=4_000_000, seconds=0.003)
        STATS.snapshot()["compression_ratio"]   # 2.0
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Zero every counter and restart the elapsed-time clock (e.g. after warm-up)."""
        with self._lock:
            self._c = dict.fromkeys(_COUNTERS, 0)
            for k in ("comm_time_s", "agreement_time_s", "codec_time_s", "exposed_wait_s"):
                self._c[k] = 0.0
            self._algorithms: dict[str, dict[str, int]] = {}
            self._since = time.perf_counter()

    # ---- recording (called by the engine, the compression layer and Work.wait) -------------
    def record_operation(self, n: int = 1) -> None:
        """Count `n` collective operations submitted to the engine."""
        with self._lock:
            self._c["operations"] += n

    def record_message(self, tensors: int, wire_bytes: int, dense_bytes: int,
                       seconds: float = 0.0) -> None:
        """Count one transport message: tensors packed, bytes sent, dense FP32 bytes, time on
        the wire."""
        with self._lock:
            c = self._c
            c["fused_operations"] += 1
            c["tensors_fused"] += tensors
            c["wire_bytes"] += wire_bytes
            c["dense_bytes"] += dense_bytes
            c["comm_time_s"] += seconds

    def record_bytes(self, wire_bytes: int, dense_bytes: int = 0) -> None:
        """Add bytes without counting a message (when one message's bytes are reported in parts)."""
        with self._lock:
            self._c["wire_bytes"] += wire_bytes
            self._c["dense_bytes"] += dense_bytes

    def record_chunks(self, sent: int, total: int) -> None:
        """Count CSC chunks selected (`sent`) out of `total` for one bucket: what
        `snapshot()["density"]` reports, so call it with the selection really sent."""
        with self._lock:
            self._c["chunks_sent"] += sent
            self._c["chunks_total"] += total

    def record_algorithm(self, algorithm: str, nbytes: int, sent: float, recv: float,
                         inter_sent: float = 0.0, inter_recv: float = 0.0) -> None:
        """Count one message of `nbytes` allreduced by `algorithm` and the bytes this rank sent
        and received for it (`inter_*`: the part that crossed hosts, where hosts are known)."""
        with self._lock:
            c = self._algorithms.get(algorithm)
            if c is None:
                c = self._algorithms[algorithm] = dict.fromkeys(ALGORITHM_FIELDS, 0)
            c["messages"] += 1
            c["bytes"] += nbytes
            c["sent_bytes"] += int(sent)
            c["recv_bytes"] += int(recv)
            c["inter_host_sent_bytes"] += int(inter_sent)
            c["inter_host_recv_bytes"] += int(inter_recv)

    def reset_algorithms(self) -> None:
        """Zero the per-algorithm counters only."""
        with self._lock:
            self._algorithms = {}

    def record_comm_time(self, seconds: float) -> None:
        """Add engine time spent in transport collectives not reported through record_message."""
        with self._lock:
            self._c["comm_time_s"] += seconds

    def record_agreement(self, seconds: float, rounds: int = 1) -> None:
        """Count agreement rounds and the engine time they took."""
        with self._lock:
            self._c["agreement_rounds"] += rounds
            self._c["agreement_time_s"] += seconds

    def record_codec_time(self, seconds: float) -> None:
        """Add engine time spent compressing or decompressing."""
        with self._lock:
            self._c["codec_time_s"] += seconds

    def record_wait(self, seconds: float) -> None:
        """Add time a user thread spent blocked waiting for an engine operation."""
        with self._lock:
            self._c["exposed_wait_s"] += seconds
            self._c["waits"] += 1

    def record_step(self, n: int = 1) -> None:
        """Count finished training steps (for per-step averages)."""
        with self._lock:
            self._c["steps"] += n

    # ---- reading -----------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """Return the counters and derived values (ratio, density, overlap, per-step) as a dict."""
        with self._lock:
            c = dict(self._c)
            algorithms = {k: dict(v) for k, v in self._algorithms.items()}
            elapsed = time.perf_counter() - self._since
        c["algorithms"] = algorithms
        c["elapsed_s"] = elapsed
        c["compression_ratio"] = c["dense_bytes"] / c["wire_bytes"] if c["wire_bytes"] else None
        c["density"] = c["chunks_sent"] / c["chunks_total"] if c["chunks_total"] else None
        busy = c["comm_time_s"] + c["agreement_time_s"] + c["codec_time_s"]
        c["busy_time_s"] = busy
        if busy > 0:
            c["overlap_fraction"] = min(1.0, max(0.0, 1.0 - c["exposed_wait_s"] / busy))
        else:
            c["overlap_fraction"] = None
        c["tensors_per_message"] = (c["tensors_fused"] / c["fused_operations"]
                                    if c["fused_operations"] else None)
        steps = c["steps"]
        c["wire_bytes_per_step"] = c["wire_bytes"] / steps if steps else None
        c["comm_time_per_step_s"] = c["comm_time_s"] / steps if steps else None
        return c


STATS = Stats()


class GroupStats:
    """One process group's engine counters; every record also adds to the process totals.

    The attributes are the group's own counts (read by tests and bench_fusion):
    ``rounds`` / ``round_s`` agreement rounds and their engine time, ``messages`` transport
    messages sent (fused, in place, and on the solo channel), ``fused_tensors`` tensors in
    them, and per route the operations issued: ``deferred`` (queued for fusion), ``eager``
    (of which ``fast_path``: sent on the caller's thread; ``inband``: allreduces summed
    inside their check round; ``exchanged``: allreduces of two ranks sent as one all-to-all,
    of which ``carried``: inside their check round, as a repeated size; ``bcast_carried``:
    broadcasts carried in their check round) and ``solo_channel``; ``checks`` /
    ``check_s`` the signature rounds of eager and solo collectives and their time. They are
    plain increments: the issuing side counts under the engine's lock (or the floor), the
    engine thread its own.
    """

    __slots__ = ("rounds", "round_s", "messages", "fused_tensors", "deferred", "eager",
                 "fast_path", "inband", "exchanged", "carried", "bcast_carried", "solo_channel",
                 "checks", "check_s", "_totals")

    def __init__(self, totals: Stats | None = None) -> None:
        self.rounds = self.messages = self.fused_tensors = 0
        self.deferred = self.eager = self.fast_path = self.solo_channel = self.checks = 0
        self.inband = self.exchanged = self.carried = self.bcast_carried = 0
        self.round_s = self.check_s = 0.0
        self._totals = totals if totals is not None else STATS

    # ---- issuing (one operation each) ----
    def record_deferred(self) -> None:
        """An allreduce queued for fusion."""
        self.deferred += 1
        self._totals.record_operation()

    def record_eager(self, fast: bool) -> None:
        """A collective sent in sequence order (`fast`: at once, on the caller's thread)."""
        self.eager += 1
        self.fast_path += fast
        self._totals.record_operation()

    def record_inband(self) -> None:
        """An eager allreduce whose data travelled inside its check round."""
        self.inband += 1

    def record_exchange(self, carried: bool = False) -> None:
        """An eager allreduce of two ranks sent as one all-to-all of the whole tensor
        (`carried`: inside its check round, which had room for it)."""
        self.exchanged += 1
        self.carried += carried

    def record_carried_broadcast(self) -> None:
        """An eager broadcast whose root's tensor travelled inside its check round."""
        self.bcast_carried += 1

    def record_solo(self, nbytes: int, numel: int) -> None:
        """An allreduce sent at once on the solo channel (its time on the wire is not seen)."""
        self.solo_channel += 1
        self.messages += 1
        self._totals.record_operation()
        self._totals.record_message(1, nbytes, numel * 4)

    def record_stages(self) -> None:
        """A multi-stage op (a compressed bucket) queued."""
        self._totals.record_operation()

    # ---- the engine thread ----
    def record_agreement(self, seconds: float, rounds: int) -> None:
        """Agreement rounds and the engine time they took."""
        self.rounds += rounds
        self.round_s += seconds
        self._totals.record_agreement(seconds, rounds)

    def record_check(self, seconds: float) -> None:
        """An eager collective's signature round (engine/checks.py) and the time it took."""
        self.checks += 1
        self.check_s += seconds

    def record_send(self, tensors: int) -> None:
        """A message handed to the transport, carrying `tensors` tensors."""
        self.messages += 1
        self.fused_tensors += tensors

    def record_message(self, tensors: int, wire_bytes: int, dense_bytes: int,
                       seconds: float = 0.0) -> None:
        """A transport message finished (Stats.record_message)."""
        self._totals.record_message(tensors, wire_bytes, dense_bytes, seconds)

    def record_codec_time(self, seconds: float) -> None:
        self._totals.record_codec_time(seconds)

    def record_bytes(self, wire_bytes: int, dense_bytes: int = 0) -> None:
        self._totals.record_bytes(wire_bytes, dense_bytes)

    def snapshot(self) -> dict:
        """The group's own counters as a dict."""
        return {k: getattr(self, k) for k in self.__slots__ if not k.startswith("_")}


def stats() -> dict:
    """Return this process's GradientFlow counters (re-exported as `gradientflow.stats`)."""
    return STATS.snapshot()


def reset_stats() -> None:
    """Zero this process's counters (re-exported as `gradientflow.reset_stats`)."""
    STATS.reset()
