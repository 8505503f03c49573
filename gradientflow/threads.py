"""Torch's intra-op thread count on the threads we start.

`torch.set_num_threads(n)` sets the OpenMP team size of the thread that calls it only; a thread
started by Python forms teams of one per core whatever the program set. Two ranks on two cores
that each set one thread then ran our codec on two, and the idle member of each team spun on
the cores the training needed. Every thread of ours that runs torch ops (the engine's, the
reaper's, the completion and algorithm executors') follows torch's setting through this module.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

_LOCAL = threading.local()


def follow_torch_threads() -> None:
    """Give this thread torch's intra-op thread count (the process's, as
    `torch.get_num_threads()` reads it), if it does not have it yet; microseconds."""
    n = torch.get_num_threads()
    if getattr(_LOCAL, "threads", None) != n:
        torch.set_num_threads(n)
        _LOCAL.threads = n


def following_torch_threads(target: Callable[..., Any]) -> Callable[..., Any]:
    """`target` as a thread's body that first follows torch's thread count."""

    def run(*args: Any, **kwargs: Any) -> Any:
        follow_torch_threads()
        return target(*args, **kwargs)

    return run
