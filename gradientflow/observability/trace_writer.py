"""The file side of the timeline: one open Chrome-trace file, its bounded buffer and its writer
thread (timeline.py records into it), and the clock every event is stamped with.

Leaf module: imports nothing of gradientflow outside observability (stdlib only).
"""
from __future__ import annotations

import collections
import json
import math
import os
import socket
import threading
import time
from typing import Any, Sequence

STEP_LANE = "steps"          # lane that carries one bar per recorded step
# Compact encoders for the writer; default=str keeps an odd arg value (a dtype, a device) legible.
_ARGS_ENCODER = json.JSONEncoder(default=str, separators=(",", ":"), allow_nan=False)
_STR_ENCODER = json.JSONEncoder()


def now_us() -> float:
    """Return the timeline clock in microseconds (use it for `complete` timestamps).

    perf_counter is CLOCK_MONOTONIC on Linux: one origin for every process on a host, so the
    ranks of one node line up in a merged trace without correction.
    """
    return time.perf_counter_ns() / 1000.0


class Session:
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
            if key == STEP_LANE:
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
                    line += ',"s":"g"' if key == STEP_LANE else ',"s":"t"'
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
