"""Record a Chrome-trace (Trace Event Format) timeline of the engine's phases, per rank.

Leaf module: imports nothing of gradientflow outside observability (stdlib only). The file
writer is trace_writer.py; reading and merging traces, trace_merge.py.

The recorder is one module-level object, `TIMELINE`. Its `enabled` attribute is a plain bool
that every recording call checks first, so a disabled recorder costs one attribute read and a
return; callers on very hot paths may test `TIMELINE.enabled` themselves and skip the call.
`enabled` is True only while a started recorder is inside its sampled step range.

Events are appended as tuples to a bounded deque (thread-safe under the GIL, no lock on the
critical path); a background writer thread turns them into JSON and writes them to the file.
When the buffer is full, new events are dropped and counted (recording never blocks training);
the count is written into the trace's ``otherData.dropped_events``.

Conventions the engine should follow (summarize.py relies on them):
  * phase names: QUEUE, FUSE, COMPRESS, ALLREDUCE, DECOMPRESS, UNPACK, AGREE (constants below);
  * categories: CAT_ENGINE (queue/fuse/unpack), CAT_CODEC (compress/decompress),
    CAT_COMM (transport collectives), CAT_AGREE (agreement rounds); CAT_COMM and CAT_AGREE count
    as communication time in the summary;
  * ``tid``: a string lane such as ``"bucket 3"`` or ``"engine"``; None means the calling thread.
    Phases that overlap in time must go on different lanes (Chrome nests events by time on a
    lane), which is why per-bucket phases recorded after the fact belong on per-bucket lanes;
  * ``mark_step(n)`` is called at the *start* of step n; events until the next mark belong to n.

Example::

    from gradientflow.observability import timeline
    timeline.start_timeline("/tmp/trace.json", steps=(10, 12), rank=0)   # -> /tmp/trace.rank0.json
    for step in range(20):
        timeline.TIMELINE.mark_step(step)
        with timeline.TIMELINE.span("compress", timeline.CAT_CODEC, tid="bucket 0"):
            ...
    timeline.stop_timeline()
"""
from __future__ import annotations

import atexit
import os
import threading
import time
from typing import Any, Mapping

from gradientflow.observability.trace_merge import _main, load_trace, merge
from gradientflow.observability.trace_writer import STEP_LANE as _STEP_LANE
from gradientflow.observability.trace_writer import Session as _Session
from gradientflow.observability.trace_writer import now_us

__all__ = [
    "TIMELINE", "Timeline", "start_timeline", "stop_timeline", "merge", "load_trace", "now_us",
    "trace_path_for_rank",
    "QUEUE", "FUSE", "COMPRESS", "ALLREDUCE", "DECOMPRESS", "UNPACK", "AGREE", "STEP",
    "CAT_ENGINE", "CAT_CODEC", "CAT_COMM", "CAT_AGREE", "CAT_STEP", "COMM_CATEGORIES",
]

# Phase names (event "name") and categories (event "cat").
QUEUE, FUSE, COMPRESS, ALLREDUCE, DECOMPRESS, UNPACK, AGREE, STEP = (
    "queue", "fuse", "compress", "allreduce", "decompress", "unpack", "agree", "step")
CAT_ENGINE, CAT_CODEC, CAT_COMM, CAT_AGREE, CAT_STEP = "engine", "codec", "comm", "agree", "step"
COMM_CATEGORIES = frozenset({CAT_COMM, CAT_AGREE})
# Events held in memory before new ones are dropped (~100-200 MB worst case).
_DEFAULT_CAPACITY = 1 << 20
_DEFAULT_FLUSH_S = 0.25       # the writer drains at least this often


def trace_path_for_rank(path: str, rank: int) -> str:
    """Return the per-rank file name: ``{rank}`` substituted, else
    ``<path minus .json>.rank<N>.json``."""
    path = os.fspath(path)
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    if path.endswith(os.sep) or os.path.isdir(path):
        return os.path.join(path, f"timeline.rank{rank}.json")
    stem = path[:-5] if path.endswith(".json") else path
    return f"{stem}.rank{rank}.json"


def _normalise_steps(steps) -> range | None:
    """Turn None, a range, or an inclusive (first, last) pair into a range (or None: all steps)."""
    if steps is None or isinstance(steps, range):
        return steps
    if isinstance(steps, (tuple, list)) and len(steps) == 2:
        first, last = int(steps[0]), int(steps[1])
        if last < first:
            raise ValueError(f"timeline steps ({first}, {last}): the last step must not precede "
                             "the first; pass (first, last) inclusive, or a range")
        return range(first, last + 1)
    raise ValueError(f"timeline steps={steps!r}: pass None (every step), a range, or an inclusive "
                     "(first, last) pair of step numbers")


def _past(steps: range, step: int) -> bool:
    """True when `step` lies beyond every step of the sampled range (so recording is over)."""
    if len(steps) == 0:
        return True
    last = steps[-1] if steps.step > 0 else steps[0]
    return step > last


class _NullSpan:
    """A do-nothing context manager returned by span() while recording is off (shared, no
    allocation)."""

    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NULL_SPAN = _NullSpan()


class _Span:
    """Context manager that records one complete ("X") event on exit."""

    __slots__ = ("_tl", "_name", "_cat", "_tid", "_args", "_t0")

    def __init__(self, tl, name, cat, tid, args):
        self._tl, self._name, self._cat, self._tid, self._args = tl, name, cat, tid, args

    def __enter__(self):
        self._t0 = time.perf_counter_ns()
        return self

    def __exit__(self, *exc):
        t1 = time.perf_counter_ns()
        tl = self._tl
        tid = self._tid
        if tid is None:
            tid = tl._thread_lane()
        tl._push(("X", self._name, self._cat, self._t0 / 1000.0, (t1 - self._t0) / 1000.0,
                  tid, self._args))
        return False


class Timeline:
    """A per-process Chrome-trace recorder with step-range sampling and a background writer."""

    def __init__(self):
        # Checked first by every recording call: True only while started and inside the
        # sampled steps.
        self.enabled = False
        self._lock = threading.RLock()       # guards start/stop/mark_step state, never the hot path
        self._started = False
        self._steps: range | None = None
        self._step: int | None = None
        self._step_t0: float | None = None
        self._session: _Session | None = None
        self._finished_path: str | None = None
        self._thread_lanes: dict[int, str] = {}
        self._fork_lock = None
        atexit.register(self._atexit)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(before=self._before_fork, after_in_parent=self._after_fork_parent,
                                after_in_child=self._after_fork_child)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self, path: str, rank: int = 0, steps=None, *, capacity: int = _DEFAULT_CAPACITY,
              flush_interval_s: float = _DEFAULT_FLUSH_S) -> str:
        """Start recording to this rank's file; return the file's path.

        Args:
            path: file name; ``{rank}`` is substituted, otherwise ``.rank<N>.json`` is appended
                (after stripping ``.json``); a directory gets ``timeline.rank<N>.json``.
            rank: the process's rank; becomes the trace's pid.
            steps: None (record everything), a range, or an inclusive (first, last) pair. With a
                range, nothing is recorded until ``mark_step`` enters it, and the file is closed
                as soon as a step past its end is marked.
            capacity: events buffered in memory; beyond it new events are dropped and counted.
            flush_interval_s: how often the writer thread drains the buffer.
        """
        if capacity < 1:
            raise ValueError(f"timeline capacity={capacity}: must be at least 1 event")
        steps = _normalise_steps(steps)
        with self._lock:
            if self._started:
                raise RuntimeError("timeline.start: a timeline is already recording to "
                                   f"{self._session.path}; call stop_timeline() first")
            out = trace_path_for_rank(path, int(rank))
            self._session = _Session(out, int(rank), capacity, flush_interval_s,
                                     self._thread_lanes)
            self._steps = steps
            self._finished_path = None
            self._step = None
            self._step_t0 = None
            self._started = True
            self.enabled = steps is None
            return out

    def stop(self) -> str | None:
        """Stop recording, flush everything and close the file with valid JSON; return its path."""
        with self._lock:
            if not self._started:
                # Already closed by sampling (past its last step): report that file once.
                finished, self._finished_path = self._finished_path, None
                return finished
            self._close_step_bar(now_us())
            self.enabled = False
            self._started = False
            session, self._session = self._session, None
        session.close()
        return session.path

    @property
    def recording(self) -> bool:
        """True between start() and stop() (even outside the sampled steps)."""
        return self._started

    @property
    def path(self) -> str | None:
        """The file of the current recording, or None."""
        s = self._session
        return s.path if s is not None else None

    def _atexit(self):
        # Interpreter exit: the closing bracket must reach the file.
        try:
            self.stop()
        except Exception:  # pragma: no cover - nothing useful to do at exit
            pass

    # A forked child (a DataLoader worker) must neither record into nor close the parent's file.
    # Holding the writer's lock across fork() guarantees the file object's buffer is empty in the
    # child (every drain flushes under that lock), so nothing the child does can write to it.
    def _before_fork(self):
        s = self._session
        self._fork_lock = s._io_lock if s is not None else None
        if self._fork_lock is not None:
            self._fork_lock.acquire()

    def _after_fork_parent(self):
        if self._fork_lock is not None:
            self._fork_lock.release()
            self._fork_lock = None

    def _after_fork_child(self):
        if self._fork_lock is not None:
            self._fork_lock.release()
            self._fork_lock = None
        self._lock = threading.RLock()   # another parent thread may have held it at fork time
        self.enabled = False
        self._started = False
        if self._session is not None:
            self._session.detached = True
        self._session = None
        self._finished_path = None

    # ---- steps and sampling ----------------------------------------------------------------
    def mark_step(self, step: int) -> None:
        """Mark the start of `step`: records an instant marker and drives step-range sampling."""
        if not self._started:
            return
        with self._lock:
            if not self._started:
                return
            t = now_us()
            self._close_step_bar(t)
            steps = self._steps
            inside = steps is None or step in steps
            self.enabled = inside
            self._step = step
            if inside:
                self._step_t0 = t
                self._push(("i", f"step {step}", CAT_STEP, t, None, _STEP_LANE, {"step": step}))
            elif steps is not None and _past(steps, step):
                # Past the sampled range: close the file now so it is complete even if the
                # process is later killed, and stop paying for anything.
                self._started = False
                session, self._session = self._session, None
                self._finished_path = session.path
                session.close()

    def _close_step_bar(self, t: float) -> None:
        if self._step_t0 is not None and self._session is not None:
            self._push(("X", STEP, CAT_STEP, self._step_t0, t - self._step_t0, _STEP_LANE,
                        {"step": self._step}))
        self._step_t0 = None

    # ---- recording (hot path) ----------------------------------------------------------------
    def span(self, name: str, cat: str, tid=None, args: Mapping[str, Any] | None = None):
        """Return a context manager that records `name` from enter to exit (one "X" event)."""
        if not self.enabled:
            return _NULL_SPAN
        return _Span(self, name, cat, tid, args)

    def complete(self, name: str, cat: str, ts_us: float, dur_us: float, tid=None,
                 args: Mapping[str, Any] | None = None) -> None:
        """Record a phase after the fact: start `ts_us` (from now_us()) lasting `dur_us`."""
        if not self.enabled:
            return
        if tid is None:
            tid = self._thread_lane()
        self._push(("X", name, cat, ts_us, dur_us, tid, args))

    def begin(self, name: str, cat: str, tid=None, args: Mapping[str, Any] | None = None) -> None:
        """Open a phase on a lane ("B"); close it with end() on the same lane, properly nested."""
        if not self.enabled:
            return
        if tid is None:
            tid = self._thread_lane()
        self._push(("B", name, cat, time.perf_counter_ns() / 1000.0, None, tid, args))

    def end(self, name: str, cat: str, tid=None, args: Mapping[str, Any] | None = None) -> None:
        """Close the innermost phase opened by begin() on this lane ("E")."""
        if not self.enabled:
            return
        if tid is None:
            tid = self._thread_lane()
        self._push(("E", name, cat, time.perf_counter_ns() / 1000.0, None, tid, args))

    def instant(self, name: str, cat: str, tid=None, args: Mapping[str, Any] | None = None) -> None:
        """Record an instant marker on a lane."""
        if not self.enabled:
            return
        if tid is None:
            tid = self._thread_lane()
        self._push(("i", name, cat, time.perf_counter_ns() / 1000.0, None, tid, args))

    def counter(self, name: str, values: Mapping[str, float], ts_us: float | None = None) -> None:
        """Record counter values (a "C" event, drawn as a stacked area chart per name)."""
        if not self.enabled:
            return
        if ts_us is None:
            ts_us = time.perf_counter_ns() / 1000.0
        self._push(("C", name, "counter", ts_us, None, 0, dict(values)))

    # ---- internals ---------------------------------------------------------------------------
    def _thread_lane(self) -> int:
        ident = threading.get_ident()
        if ident not in self._thread_lanes:
            self._thread_lanes[ident] = threading.current_thread().name
        return ident

    def _push(self, ev: tuple) -> None:
        s = self._session
        if s is None:          # stopped between the enabled check and here
            return
        buf = s.buffer
        if len(buf) >= s.capacity:
            s.dropped += 1     # a lost increment under a race only under-reports drops
            return
        buf.append(ev)
        if len(buf) >= s.high_water and not s.wake.is_set():
            s.wake.set()


TIMELINE = Timeline()


def start_timeline(path: str, steps=None, rank: int | None = None) -> str:
    """Start the process's timeline (re-exported as `gradientflow.start_timeline`); return its file.

    Args:
        path: where to write; see `Timeline.start` for how the rank enters the file name.
        steps: None (every step), a range, or an inclusive (first, last) pair of step numbers.
        rank: defaults to torch.distributed's rank when it is initialised, else 0.
    """
    if rank is None:
        rank = _default_rank()
    return TIMELINE.start(path, rank=rank, steps=steps)


def stop_timeline() -> str | None:
    """Stop the timeline, writing the file completely (re-exported as
    `gradientflow.stop_timeline`)."""
    return TIMELINE.stop()


def _default_rank() -> int:
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # torch absent or half-initialised: a single process
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
