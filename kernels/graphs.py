"""Replay a host-bound sequence of CUDA launches as one CUDA graph per layout.

A CSC step on a GPU is about a dozen short launches (norms, ``torch.topk``, selection, pack,
the local copy, unpack) that each cost the host more than the device, so the step is bound by
the host's launch path, not by memory (benchmarks/results/gpu_check/). ``StepGraphs(fn)`` runs
``fn`` eagerly the first time it sees a layout (which compiles whatever ``fn`` launches), the
second time captures it into a CUDA graph and replays it, and from then on only replays it:
one host call a step.

A layout is every tensor argument's address, shape, strides, dtype and device, with the other
arguments' values. The graph reads and writes the arguments' own memory (nothing is copied in or
out), so it stays correct when their contents change between calls; another tensor, or the same
one at another address, is another layout. What ``fn`` allocates lives in the graph's private
memory pool: a replay overwrites what the previous call of that layout returned, so a caller that
keeps a result past the next call of the same layout clones it.

``fn`` must be capturable: no host synchronisation (``.item()``, ``bool(t)``, ``nonzero``, a
shape read from the device) and only ``fn``'s tensor arguments and its own allocations touched
on the device. It runs eagerly instead (the same results, without a graph) for arguments that
are not all CUDA tensors (CPU, the numba simulator), on a stream that is already being captured
(the caller's own graph records the launches), for arguments that cannot form a key, and for a
layout whose capture failed (a host sync, an op CUDA graphs refuse): that layout stays eager
and one ``RuntimeWarning`` says why. At most ``max_graphs`` layouts keep a graph; the least
recently used one is dropped for a new one.

This module is part of the kernels LEAF and imports nothing of gradientflow.
"""
from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["StepGraphs"]

_EAGER = object()  # a layout whose capture failed: run eagerly from then on
_SCALARS = (int, float, bool, str, type(None), torch.dtype)


def _key_of(x: Any):
    """One argument's part of the layout key; None where it cannot be one (run eagerly)."""
    if isinstance(x, torch.Tensor):
        if not x.is_cuda:
            return None
        return ("t", x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, x.device.index)
    if isinstance(x, _SCALARS):
        return ("v", type(x).__name__, x)
    return None


def _layout(args: tuple, kwargs: dict):
    """The layout key of a call, or None where it must run eagerly (see the module docstring)."""
    parts = []
    device = None
    for x in (*args, *(kwargs[name] for name in sorted(kwargs))):
        part = _key_of(x)
        if part is None:
            return None, None
        if part[0] == "t":
            if device is not None and x.device != device:
                return None, None  # one graph runs on one device
            device = x.device
        parts.append(part)
    if device is None:
        return None, None  # no CUDA tensor: nothing to capture
    return (tuple(sorted(kwargs)), *parts), device


class StepGraphs:
    """Run ``fn(*args, **kwargs)`` as one CUDA graph per layout: eager once, then replayed.

    Args:
        fn: the step; its arguments are tensors and plain values (numbers, strings, dtypes,
            None), it returns whatever its eager call returns (tensors it allocated are the
            graph's: overwritten by the next replay of the same layout).
        max_graphs: how many layouts keep a captured graph (>= 1).

    Example::

        step = StepGraphs(csc_step)
        for _ in range(steps):
            norms, idx, packed = step(grad, residual, spare, send, k=k)
    """

    def __init__(self, fn: Callable, *, max_graphs: int = 8) -> None:
        if not callable(fn):
            raise TypeError(f"StepGraphs: fn must be callable, got {type(fn).__name__}")
        if not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"StepGraphs: max_graphs must be an int >= 1, got {max_graphs!r}")
        # given by the user
        self.fn = fn
        self.max_graphs = max_graphs
        # internal: layout -> (graph, its result) or _EAGER; layouts seen once (warmed up)
        self._graphs: OrderedDict = OrderedDict()
        self._warm: set = set()
        self._lock = threading.Lock()
        # statistics (their own lock: eager calls count outside the graphs' lock)
        self.counts = {"eager": 0, "captured": 0, "replayed": 0, "failed": 0}
        self._count_lock = threading.Lock()

    def __call__(self, *args, **kwargs):
        key, device = _layout(args, kwargs)
        if key is None or torch.cuda.is_current_stream_capturing():
            return self._eager(args, kwargs)
        with self._lock:
            entry = self._graphs.get(key)
            if entry is not None and entry is not _EAGER:
                self._graphs.move_to_end(key)
                graph, result = entry
                with torch.cuda.device(device):
                    graph.replay()
                self._bump("replayed")
                return result
            if entry is None and key in self._warm:
                self._warm.discard(key)
                return self._capture(key, device, args, kwargs)
            # The first call compiles and loads what fn launches (not allowed in a capture).
            if entry is None:
                if len(self._warm) >= 4 * self.max_graphs:
                    self._warm.clear()  # layouts that never came back (new addresses each call)
                self._warm.add(key)
        return self._eager(args, kwargs)

    def _bump(self, name: str) -> None:
        with self._count_lock:
            self.counts[name] += 1

    def _eager(self, args, kwargs):
        self._bump("eager")
        return self.fn(*args, **kwargs)

    def _store(self, key, entry) -> None:
        """Keep `entry` for `key` as the newest; the oldest graphs beyond max_graphs, and the
        oldest failed layouts beyond 4 x max_graphs, are forgotten (graph memory and the map
        stay bounded however many layouts come and go)."""
        self._graphs[key] = entry
        self._graphs.move_to_end(key)
        for failed, cap in ((False, self.max_graphs), (True, 4 * self.max_graphs)):
            keys = [k for k, e in self._graphs.items() if (e is _EAGER) == failed]
            for k in keys[:max(0, len(keys) - cap)]:
                del self._graphs[k]

    def _capture(self, key, device, args, kwargs):
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream(device)
        try:
            with torch.cuda.device(device):
                # thread_local: another thread's synchronising call (the engine's) is not an
                # error of this capture; this thread's is, and makes the layout eager.
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    result = self.fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any capture failure means "run eagerly"
            # A failed capture_end leaves the capture stream current: give the caller's back.
            torch.cuda.set_stream(stream)
            self._store(key, _EAGER)
            self._bump("failed")
            warnings.warn(f"StepGraphs: {getattr(self.fn, '__name__', self.fn)!r} cannot be "
                          f"captured as a CUDA graph ({exc!r}); that layout runs eagerly",
                          RuntimeWarning, stacklevel=3)
            return self._eager(args, kwargs)
        self._store(key, (graph, result))
        self._bump("captured")
        # A capture records the launches without running them: run this call's step now.
        with torch.cuda.device(device):
            graph.replay()
        return result

    def clear(self) -> None:
        """Drop every graph (and its memory) and every layout's history."""
        with self._lock:
            self._graphs.clear()
            self._warm.clear()
