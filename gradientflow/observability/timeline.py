"""Record a Chrome-trace (Trace Event Format) timeline of the engine's phases, per rank.

Leaf module: imports nothing of gradientflow (stdlib only).

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
import collections
import json
import math
import os
import socket
import threading
import time
from typing import Any, Iterable, Mapping, Sequence

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

_STEP_LANE = "steps"          # lane that carries one bar per recorded step
# Events held in memory before new ones are dropped (~100-200 MB worst case).
_DEFAULT_CAPACITY = 1 << 20
_DEFAULT_FLUSH_S = 0.25       # the writer drains at least this often
# Compact encoders for the writer; default=str keeps an odd arg value (a dtype, a device) legible.
_ARGS_ENCODER = json.JSONEncoder(default=str, separators=(",", ":"), allow_nan=False)
_STR_ENCODER = json.JSONEncoder()


def now_us() -> float:
    """Return the timeline clock in microseconds (use it for `complete` timestamps).

    perf_counter is CLOCK_MONOTONIC on Linux: one origin for every process on a host, so the
    ranks of one node line up in a merged trace without correction.
    """
    return time.perf_counter_ns() / 1000.0


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


class _Session:
    """One open trace file: its buffer, its writer thread, and the JSON it has written so far."""

    def __init__(self, path: str, rank: int, capacity: int, flush_interval_s: float,
                 thread_lanes: dict[int, str]):
        self.path = path
        self.rank = rank
        self.capacity = capacity
        self.high_water = max(1, capacity // 2)
        self.flush_interval_s = flush_interval_s
        self.buffer: collections.deque = collections.deque()
        self.dropped = 0
        self.events_written = 0
        self.wake = threading.Event()
        self._closing = False
        self._closed = False
        self.detached = False   # set in a forked child: the file belongs to the parent
        self._io_lock = threading.Lock()
        self._thread_lanes = thread_lanes
        self._lanes: dict[Any, int] = {}      # lane key -> small integer tid in the file
        self._strings: dict[str, str] = {}    # name/category -> its JSON encoding
        self._wall_minus_mono_us = time.time_ns() / 1000.0 - now_us()
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._fh = open(path, "w", encoding="utf-8")
        except OSError as exc:
            raise OSError(f"timeline.start on rank {rank}: cannot write the trace {path!r} "
                          f"({exc.strerror or exc}); pass a writable file or directory "
                          "(start_timeline(path) or GRADIENTFLOW_TIMELINE)") from exc
        self._fh.write('{"traceEvents":[\n')
        self._first = True
        self._write_raw({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                         "args": {"name": f"rank {rank}"}})
        self._write_raw({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                         "args": {"sort_index": rank}})
        self._writer = threading.Thread(target=self._run, name=f"gradientflow-timeline-{rank}",
                                        daemon=True)
        self._writer.start()

    # writer thread
    def _run(self) -> None:
        while True:
            self.wake.wait(self.flush_interval_s)
            self.wake.clear()
            closing = self._closing
            self._drain()
            if closing:
                return

    def _lane(self, key) -> int:
        tid = self._lanes.get(key)
        if tid is None:
            tid = len(self._lanes) + 1
            self._lanes[key] = tid
            if key == _STEP_LANE:
                name, sort = "steps", -1
            elif isinstance(key, str):
                name, sort = key, tid
            elif key in self._thread_lanes:
                name, sort = f"thread {self._thread_lanes[key]}", tid
            else:
                name, sort = f"lane {key}", tid
            self._write_raw({"ph": "M", "name": "thread_name", "pid": self.rank, "tid": tid,
                             "args": {"name": name}})
            self._write_raw({"ph": "M", "name": "thread_sort_index", "pid": self.rank,
                             "tid": tid, "args": {"sort_index": sort}})
        return tid

    def _drain(self) -> None:
        # Hand-formatted JSON: json.dumps of a dict per event costs ~10 us here, this ~2 us.
        # Names and categories repeat, so their JSON encodings are cached.
        with self._io_lock:
            if self._closed:
                return
            buf, pid, parts = self.buffer, self.rank, []
            enc, strings, lane = _ARGS_ENCODER.encode, self._strings, self._lane
            isfinite = math.isfinite
            while True:
                try:
                    ph, name, cat, ts, dur, key, args = buf.popleft()
                except IndexError:
                    break
                n = strings.get(name)
                if n is None:
                    n = strings[name] = _STR_ENCODER.encode(str(name))
                c = strings.get(cat)
                if c is None:
                    c = strings[cat] = _STR_ENCODER.encode(str(cat))
                if not isfinite(ts) or (dur is not None and not (isfinite(dur) and dur >= 0)):
                    self.dropped += 1   # a caller's NaN/negative time would make invalid JSON
                    continue
                # Counters are per process (tid 0); %.3f keeps the clock's nanoseconds and no
                # float noise.
                tid = 0 if ph == "C" else lane(key)
                line = '{"ph":"%s","name":%s,"cat":%s,"ts":%.3f,"pid":%d,"tid":%d' % (
                    ph, n, c, ts, pid, tid)
                if dur is not None:
                    line += ',"dur":%.3f' % dur
                if ph == "i":
                    line += ',"s":"g"' if key == _STEP_LANE else ',"s":"t"'
                if args:
                    try:
                        line += ',"args":' + enc(args)
                    except (TypeError, ValueError):
                        line += ',"args":' + enc({"repr": repr(args)})
                parts.append(line + "}")
            if parts:
                self.events_written += len(parts)
                self._write_lines(parts)
            self._fh.flush()

    def _write_raw(self, ev: dict) -> None:
        self._write_lines([json.dumps(ev)])

    def _write_lines(self, lines: Sequence[str]) -> None:
        sep = ",\n"
        text = sep.join(lines)
        if not self._first:
            text = sep + text
        self._first = False
        self._fh.write(text)

    def close(self) -> None:
        """Drain, write the closing bracket, close the file (idempotent, from any thread)."""
        if self._closed or self.detached:
            return
        self._closing = True
        self.wake.set()
        if self._writer is not threading.current_thread():
            self._writer.join(timeout=30.0)
        self._drain()  # whatever arrived after the writer's last drain
        with self._io_lock:
            if self._closed:
                return
            other = {"rank": self.rank, "host": socket.gethostname(),
                     "wall_minus_mono_us": self._wall_minus_mono_us,
                     "dropped_events": self.dropped, "events": self.events_written,
                     "clock": "perf_counter (CLOCK_MONOTONIC), microseconds"}
            self._fh.write("\n],\n\"displayTimeUnit\":\"ms\",\n\"otherData\":"
                           + json.dumps(other) + "}\n")
            self._fh.close()
            self._closed = True


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


# ---- reading and merging -----------------------------------------------------------------
def load_trace(path: str) -> dict:
    """Load a trace file, repairing one cut short by a killed process (missing closing bracket)."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        body = text.rstrip().rstrip(",")
        # A kill can land mid-line: drop the partial last event.
        for candidate in (body + "\n]}", body[: body.rfind("\n")].rstrip().rstrip(",") + "\n]}"):
            try:
                data = json.loads(candidate)
                break
            except json.JSONDecodeError:
                continue
        else:
            raise ValueError(f"load_trace: {path} is not a Chrome trace (JSON) and could not be "
                             "repaired; was it written by gradientflow's timeline?") from None
    if isinstance(data, list):  # the JSON-array flavour of the format
        data = {"traceEvents": data}
    if "traceEvents" not in data:
        raise ValueError(f"load_trace: {path} has no traceEvents list; not a Chrome trace")
    return data


def merge(paths: Iterable[str], out: str, align: str = "auto") -> str:
    """Merge per-rank traces into one file, pid = rank; return `out`.

    Args:
        paths: the per-rank files.
        out: the merged file.
        align: "none" keeps timestamps (exact on one host: one monotonic clock), "wall" shifts
            each rank by its wall-clock offset (for ranks on several hosts, as good as NTP),
            "auto" picks "wall" only when the files come from more than one host.
    """
    if align not in ("auto", "none", "wall"):
        raise ValueError(f"merge align={align!r}: choose 'auto', 'none' or 'wall'")
    traces = [load_trace(p) for p in paths]
    if not traces:
        raise ValueError("merge: no trace files given")
    hosts = {t.get("otherData", {}).get("host") for t in traces}
    if align == "auto":
        align = "wall" if len(hosts) > 1 else "none"
    ref = traces[0].get("otherData", {}).get("wall_minus_mono_us", 0.0)
    events, ranks = [], []
    for index, t in enumerate(traces):
        other = t.get("otherData", {})
        rank = other.get("rank", index)
        ranks.append(other)
        shift = other.get("wall_minus_mono_us", ref) - ref if align == "wall" else 0.0
        for ev in t["traceEvents"]:
            ev = dict(ev)
            ev["pid"] = rank
            if shift and "ts" in ev and ev.get("ph") != "M":
                ev["ts"] = ev["ts"] + shift
            events.append(ev)
    merged = {"traceEvents": events, "displayTimeUnit": "ms",
              "otherData": {"merged_from": [os.fspath(p) for p in paths], "align": align,
                            "ranks": ranks}}
    tmp = f"{out}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(merged, fh)
    os.replace(tmp, out)
    return out


def _main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m gradientflow.observability.timeline",
                                description="Merge per-rank GradientFlow traces into one "
                                "(pid = rank).")
    p.add_argument("out", help="merged trace to write")
    p.add_argument("inputs", nargs="+", help="per-rank trace files")
    p.add_argument("--align", default="auto", choices=("auto", "none", "wall"))
    a = p.parse_args(argv)
    print(merge(a.inputs, a.out, align=a.align))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
