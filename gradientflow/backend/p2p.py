"""Point-to-point parts of the torch API on a Python backend: what works, what cannot.

monitored_barrier runs gloo's own, on the group's CPU transport: gloo implements it with
send/recv on a tag of its own, so it never pairs with a collective, and its errors are gloo's
("Rank 1 failed to pass monitoredBarrier ...", "Rank 0 timed out in monitoredBarrier").

What torch 2.14 does not let a Python subclass of its `Backend` do (torch/csrc/distributed/
c10d/py/PyBackend.hpp wraps every Work such a backend returns in a PyWorkHolder, which
forwards wait() and get_future() only). Before 2.14 the backend is a `ProcessGroup` subclass
(backend.py), whose Works reach the user as gloo made them, so neither limit applies there:
- `Work.is_completed()` of isend/irecv (and of every Work) stays False: the holder's own
  completed flag is never set. wait() and get_future().done() are right.
- A receive from any source: `dist.recv(t)` without src reads `work._source_rank()`, which the
  holder does not forward, so it could never return the sender. recv_anysource raises
  (RECV_ANYSOURCE_ERROR) instead of receiving a message whose sender nobody could be told.
"""
from __future__ import annotations

import datetime
from typing import Any

import torch

from gradientflow.backend import validate as V

RECV_ANYSOURCE_ERROR = (
    "a receive from any source (src=None) cannot report its sender through a Python backend "
    "in torch 2.14 (the Work wrapper does not forward source_rank)")


def monitored_barrier(backend: Any, opts: Any = None, wait_all_ranks: bool = False) -> None:
    """gloo's monitored barrier on `backend`'s CPU transport, after its queued collectives
    were handed to the transport (a local hint: every rank flushes at its own barrier)."""
    # BarrierOptions from torch's Backend path; a timedelta where the backend is the whole
    # ProcessGroup (dist.monitored_barrier calls group.monitored_barrier(timeout, ...)).
    timeout = opts if isinstance(opts, datetime.timedelta) else getattr(opts, "timeout", None)
    if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() < 0:
        timeout = backend._timeout
    backend.engine.flush()
    gloo = backend.transports.get(torch.device("cpu"))
    gloo.monitored_barrier(timeout, wait_all_ranks)


def recv_anysource_error(rank: int) -> V.CollectiveError:
    """The error a receive from any source raises (before anything is received)."""
    return V.fail(rank, "recv", RECV_ANYSOURCE_ERROR,
                  "name the source rank: dist.recv(tensor, src=...), or all_gather who sends")
