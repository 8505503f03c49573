"""What the engine's threads take from the callers' CUDA streams: callers' writes before the
transport reads them, the engine's unpack before callers read the results. (Torch's intra-op
thread count, the other thing a thread of ours takes from the caller: `gradientflow/threads.py`.)

A CUDA kernel is ordered only with the kernels of its own stream, and the current stream is
per thread. The engine packs, sends and unpacks on its own thread, so without this module a
fused message could be packed while the caller's stream is still writing its tensors, and a
caller on a side stream could read a tensor before the unpack into it ran (seen on an H100:
5 of 8 runs of tests/gpu/_world1.py's side-stream check returned stale values).

The rules, the same as torch's own collectives follow across threads:

- `mark(device)`, on the submitting thread: an event on its current stream. The engine's
  stream waits on the marks of the ops it is about to read (only the newest mark of each
  caller stream: events on one stream complete in order).
- The engine reads, sends and unpacks on one stream of its own per device (`EngineStreams`).
  NCCL orders its stream after the current stream of the launching thread, and Work.wait()
  orders the current stream after NCCL, so packing, sending and unpacking on one stream are
  ordered without a host wait. A segment freed by an unpack can be packed again at once:
  the next pack is queued behind the unpack on the same stream.
- Futures of CUDA ops are CUDA futures (`future_devices`), completed with the engine's stream
  current (`completion.complete(..., stream=...)`): they record an event there, and wait() /
  value() / then() make the waiter's current stream wait for it, as c10d's NCCL Works do.

On CPU every stream function here is a no-op that costs one device-type test.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch


def current(device: torch.device) -> Any:
    """This thread's current CUDA stream of `device` (None on CPU)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def mark(device: torch.device) -> Any:
    """(stream, event) recorded on this thread's current stream of `device`; None on CPU."""
    stream = current(device)
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return stream, event


def future_devices(device: torch.device) -> list[torch.device] | None:
    """The `devices` of a torch Future completed with tensors on `device` (None on CPU)."""
    return [device] if device.type == "cuda" else None


class EngineStreams:
    """One stream per CUDA device for one engine thread's packs, launches and unpacks."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device)
        return s

    @contextlib.contextmanager
    def after(self, device: torch.device, marks: Iterable[Any]) -> Iterator[Any]:
        """Make the engine's stream of `device` current, once it waited on `marks`.

        Yields that stream (None on CPU, where nothing is done).
        """
        if device.type != "cuda":
            yield None
            return
        s = self.stream(device)
        newest: dict[Any, Any] = {}
        for m in marks:
            if m is not None:
                newest[m[0]] = m[1]  # later marks of one caller stream cover earlier ones
        for event in newest.values():
            s.wait_event(event)
        with torch.cuda.stream(s):
            yield s
