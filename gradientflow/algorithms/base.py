"""What every algorithm shares: its Work, its executor thread, its byte counters, its errors.

An algorithm allreduces one flat message (a fused message, a solo tensor or a compressed stage
message) over torch.distributed groups and returns a c10d Work, as the transport's own
allreduce would: the engine waits on it, the solo channel hands it to the caller. Algorithms
made of several collectives on several groups (hierarchical, reduction_server) run them one
after the other on an executor thread per channel, in submission order: every rank submits the
same messages in the same order (the engine's agreed launch order, or the solo channel's issue
order), so the executors pair the same collectives everywhere.
"""
from __future__ import annotations

import collections
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from gradientflow.threads import following_torch_threads
from gradientflow.errors import StepFailed  # noqa: F401  (raised here, re-exported)
from gradientflow.observability.stats import STATS

__all__ = ["AlgorithmWork", "Executor", "StepFailed", "record_bytes", "algorithm_stats",
           "reset_algorithm_stats"]


class AlgorithmWork(dist.Work):
    """A c10d Work over a torch Future: wait() raises the algorithm's error (c10d's own
    future-backed Work swallows it), get_future() gives the reduced tensor list."""

    def __init__(self, fut: torch.futures.Future) -> None:
        super().__init__()
        self._fut = fut
        self._done = threading.Event()
        fut.add_done_callback(lambda _f: self._done.set())

    def wait(self, timeout=None) -> bool:
        """Block until the message is reduced; raise its error. With a `timeout` (a timedelta
        or seconds) that passes first, raise RuntimeError with is_completed() still False,
        as a transport Work does (the inspector waits in such slices)."""
        if timeout is not None:
            secs = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
            if secs > 0 and not self._done.wait(secs):
                raise RuntimeError(f"gradientflow: allreduce still running after {secs:.1f} s")
        self._fut.wait()
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        if not self._fut.done():
            return False
        try:
            self._fut.value()
        except Exception:  # noqa: BLE001
            return False
        return True

    def get_future(self) -> torch.futures.Future:
        return self._fut

    def result(self) -> list:
        return self._fut.value()


class Executor:
    """One thread running submitted jobs in order; each job's result completes its future."""

    def __init__(self, name: str) -> None:
        self._q: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        # Its reductions run with torch's thread count (gradientflow/threads.py).
        self._thread = threading.Thread(target=following_torch_threads(self._main), name=name,
                                        daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], list]) -> AlgorithmWork:
        fut: torch.futures.Future = torch.futures.Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("gradientflow: the algorithm's executor was shut down")
            self._q.append((job, fut))
            self._cv.notify()
        return AlgorithmWork(fut)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()

    def _main(self) -> None:
        while True:
            with self._cv:
                while not self._q and not self._closed:
                    self._cv.wait()
                if not self._q:
                    return
                job, fut = self._q.popleft()
            try:
                out = job()
            except BaseException as exc:  # noqa: BLE001 - delivered through the Work
                fut.set_exception(exc)
                continue
            fut.set_result(out)


# ---- bytes per algorithm ------------------------------------------------------------------
# Counted in the one statistics sink (gradientflow.stats()["algorithms"]): what this rank hands
# to / takes from the network for gradient messages, as the algorithm's protocol defines it
# (ring: the transport's ring, 2(n-1)/n of the message each way). `inter_host_*` is the part
# that crosses hosts when the hierarchy is known.
def record_bytes(algorithm: str, nbytes: int, sent: float, recv: float,
                 inter_sent: float = 0.0, inter_recv: float = 0.0) -> None:
    """Count one message of `nbytes` allreduced by `algorithm`, and its traffic."""
    STATS.record_algorithm(algorithm, nbytes, sent, recv, inter_sent, inter_recv)


def algorithm_stats() -> dict[str, dict[str, int]]:
    """Per algorithm: messages, their bytes, and the bytes this rank sent and received."""
    return STATS.snapshot()["algorithms"]


def reset_algorithm_stats() -> None:
    """Zero the per-algorithm counters."""
    STATS.reset_algorithms()


def sum_op(opts: Any) -> bool:
    """Whether the allreduce options ask for a plain SUM (what the multi-group paths do)."""
    from torch._C._distributed_c10d import ReduceOp

    op = opts.reduceOp
    return getattr(op, "op", op) == ReduceOp.SUM or op == ReduceOp.SUM
