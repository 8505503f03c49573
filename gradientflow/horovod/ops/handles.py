"""The integer handles of async collectives (poll, synchronize), Horovod's name table, and the
checks and helpers every collective shares."""
from __future__ import annotations

import contextlib
import itertools
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from gradientflow.errors import CollectiveMismatchError, EngineError
from gradientflow.horovod import basics
from gradientflow.horovod.basics import HorovodInternalError, ProcessSet


class _Pending:
    """One async operation: its torch Works, and what turns their result into the output."""

    def __init__(self, works: list, finish: Callable[[], Any], keep: Any = None,
                 label: str = "", names: tuple = ()) -> None:
        self.works = works
        self.finish = finish
        self.keep = keep  # the input, alive until synchronize (as Horovod's handle map does)
        self.futures: Optional[list] = None
        self.label = label  # "hvd.allreduce of tensor 'x'", for errors
        self.names = names  # the (process set, name) keys it holds until synchronize

    def done(self) -> bool:
        if self.futures is None:
            # Asked for on first use, not at launch: a fused allreduce's future closes its batch.
            self.futures = [w.get_future() for w in self.works]
        return all(f.done() for f in self.futures)


_handles: dict[int, _Pending] = {}
_next_handle = itertools.count(1)
# (process set id, name) -> the handle of the operation that uses the name (Horovod's tensor
# table: a name is refused while an operation of that name is unfinished on this rank).
_names: dict[tuple, int] = {}


def _label(op_name: str, name: Any) -> str:
    return f"hvd.{op_name}" + (f" of tensor {name!r}" if name is not None else "")


def _claim(op_name: str, name: Any, process_set: ProcessSet) -> tuple:
    """The name key of a new operation; ValueError if an unfinished one uses the name."""
    if name is None:
        return ()
    key = (process_set.process_set_id, str(name))
    h = _names.get(key)
    p = _handles.get(h) if h is not None else None
    if p is not None and not p.done():
        raise ValueError(f"{_label(op_name, name)}: a collective named {str(name)!r} is still "
                         f"in progress on rank {basics.rank()} (handle {h}); Horovod refuses a "
                         "second one with the same name. Synchronize the first, or name this "
                         "one differently.")
    return (key,)


@contextlib.contextmanager
def _naming(op_name: str, name: Any) -> Iterator[None]:
    """Errors raised at the call name the Horovod op and the tensor."""
    try:
        yield
    except (CollectiveMismatchError, EngineError) as exc:
        raise _renamed(exc, _label(op_name, name)) from exc


def _renamed(exc: BaseException, label: str) -> BaseException:
    """`exc` as the same type, its message led by `label` (what refused it is kept)."""
    try:
        new = type(exc)(f"{label}: {exc}")
    except Exception:  # noqa: BLE001 - an exception type that takes other arguments
        return exc
    new.refused = getattr(exc, "refused", None)
    return new


def _new_handle(works: list, finish: Callable[[], Any], keep: Any = None, label: str = "",
                names: tuple = ()) -> int:
    h = next(_next_handle)
    _handles[h] = _Pending([w for w in works if w is not None], finish, keep, label, names)
    for key in names:
        _names[key] = h
    return h


def _merge(handles: list, label: str = "", names: tuple = ()) -> int:
    """One handle for several: its works are all of theirs; its output, the list of theirs."""
    parts = [_handles.pop(h) for h in handles]
    label = label or (parts[0].label if parts else "")
    return _new_handle([w for p in parts for w in p.works], lambda: [p.finish() for p in parts],
                       [p.keep for p in parts], label, names)


def poll(handle: int) -> bool:
    """Return whether the operation behind `handle` finished (synchronize() won't block)."""
    p = _handles.get(handle)
    if p is None:
        raise ValueError(f"poll: handle {handle} was not created or has been cleared (by "
                         "synchronize)")
    return p.done()


def synchronize(handle: int):
    """Wait for the operation behind `handle`; return its output (None for an unknown handle).

    A failure (ranks that issued it differently, a peer that died, a timeout) is raised as
    HorovodInternalError (a RuntimeError), naming the op and the tensor.
    """
    p = _handles.pop(handle, None)
    if p is None:
        return None
    for key in p.names:
        if _names.get(key) == handle:
            del _names[key]
    try:
        for w in p.works:
            w.wait()
    except (RuntimeError, dist.DistBackendError) as exc:
        raise HorovodInternalError(f"{p.label}: {exc}" if p.label else exc) from exc
    return p.finish()


# ---------------------------------------------------------------------------------- helpers
def _now(process_set: ProcessSet, start: Callable[[], int]):
    """Issue allreduces with `start()` and wait for them: on a gradientflow group they are
    agreed as one batch once issued, so ranks that issued them differently get the error and
    the job goes on (backend.api.waited)."""
    from gradientflow.backend.api import waited

    member = (isinstance(process_set, ProcessSet) and process_set.process_set_id is not None
              and process_set.included())
    with waited(process_set.group() if member else None):
        handle = start()
    return synchronize(handle)


def _group(process_set: ProcessSet, op_name: str):
    """(torch group, set size, rank in set) of a registered set this process belongs to."""
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"{op_name}: process_set must be an hvd.ProcessSet, got "
                         f"{type(process_set).__name__}")
    basics.size()  # raises "Horovod has not been initialized; use hvd.init()."
    group = process_set.group()  # raises for a set that is not registered
    if not process_set.included():
        raise ValueError(f"{op_name}: Rank {basics.rank()} is not a member of the provided "
                         f"process set {process_set}.")
    return group, process_set.size(), process_set.rank()


def _check_tensor(tensor, op_name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{op_name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError("Tensor is required to be contiguous.")


def _scale_(t: torch.Tensor, factor: float) -> None:
    """Multiply in place; integers through float64, truncated, as Horovod scales them."""
    if factor == 1.0:
        return
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.mul_(factor)
    else:
        t.copy_(torch.trunc(t.to(torch.float64) * factor).to(t.dtype))


def _check_compression(compression, op_name: str) -> None:
    if getattr(compression, "tensor_level", True) is False:
        raise ValueError(f"{op_name}: compression={compression.__name__} keeps state across "
                         "steps (a residual) agreed with the other ranks, so it compresses "
                         "gradients only: pass "
                         "it to hvd.DistributedOptimizer, or use Compression.fp16 here")
