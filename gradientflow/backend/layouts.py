"""Tensor layouts gloo accepts beyond dense contiguous ones: strided views and sparse COO.

Strided views. gloo takes a non-contiguous tensor in most collectives, but reads or writes
its storage as if it were contiguous: on torch 2.14, `all_reduce` of `x[:, 0]` reduces the
first `numel` elements of the storage, not the view (tests/conformance/test_strided.py shows
it). Here each non-contiguous tensor is replaced by a contiguous copy before the call, and the
copies of the outputs are written back into the views when the operation completes (on
`wait()`, or before the future's value is seen). Where gloo refuses a strided tensor (send,
recv, the input of all_to_all_single), we refuse it too, before anything is sent.

Sparse COO. gloo sums sparse COO tensors in all_reduce (SUM only), which Horovod users rely on
for embedding gradients; such an all_reduce goes to the transport as an eager collective,
in sequence order like any other.

`conform(cls)` wraps the collectives of the backend class; a call whose tensors are all
dense and contiguous goes straight to the original method.
"""
from __future__ import annotations

import datetime
import functools
import threading
from typing import Any, Callable

import torch
from torch._C._distributed_c10d import ReduceOp, Work

from gradientflow.backend import validate as V

# The collectives whose first argument is their output (in place for allreduce, broadcast,
# reduce): every later argument is an input.
STAGED = (
    "allreduce", "allreduce_coalesced", "reduce", "broadcast", "allgather", "_allgather_base",
    "all_gather_single", "allgather_coalesced", "allgather_into_tensor_coalesced",
    "all_gather_single_coalesced", "reduce_scatter", "_reduce_scatter_base",
    "reduce_scatter_single", "reduce_scatter_tensor_coalesced",
    "reduce_scatter_single_coalesced", "alltoall", "gather", "scatter",
)
# Where gloo itself refuses a strided tensor: (method, argument index, what gloo says).
REFUSED = {
    "send": ((0, "input tensor has to be contiguous"),),
    "recv": ((0, "output tensor has to be contiguous"),),
    "alltoall_base": ((1, "Tensors must be contiguous"),),
    "all_to_all_single": ((1, "Tensors must be contiguous"),),
}
# all_to_all_single's output may be strided on gloo (staged like the others).
_STAGED_FIRST = {"alltoall_base": 0, "all_to_all_single": 0}


def _strided_view(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_contiguous()


def _has_view(arg: Any) -> bool:
    if isinstance(arg, torch.Tensor):
        return _strided_view(arg)
    if isinstance(arg, (list, tuple)):
        return any(_has_view(a) for a in arg)
    return False


def _stage(arg: Any, pairs: list | None) -> Any:
    """`arg` with each strided view replaced by a contiguous copy; (view, copy) into pairs."""
    if isinstance(arg, torch.Tensor):
        if not _strided_view(arg):
            return arg
        copy = arg.contiguous()
        if pairs is not None:
            pairs.append((arg, copy))
        return copy
    if isinstance(arg, list):
        return [_stage(a, pairs) for a in arg]
    if isinstance(arg, tuple):
        return tuple(_stage(a, pairs) for a in arg)
    return arg


class WriteBackWork(Work):
    """The Work of a collective run on contiguous copies: completing it writes the copies of
    the outputs back into the caller's views (once, before wait() returns or the future's
    value is seen)."""

    def __init__(self, inner: Any, pairs: list) -> None:
        super().__init__()
        self._inner = inner
        self._pairs = pairs
        self._lock = threading.Lock()

    def _write_back(self) -> None:
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for view, copy in pairs:
            view.copy_(copy)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:  # noqa: D401
        """Wait for the collective, then write its outputs into the views."""
        if timeout is None:
            self._inner.wait()
        else:
            self._inner.wait(timeout)
        self._write_back()
        return True

    def get_future(self) -> torch.futures.Future:
        """The collective's future, completing after the write-back."""

        def done(fut: torch.futures.Future) -> Any:
            value = fut.value()  # re-raises the collective's error
            self._write_back()
            return value

        return self._inner.get_future().then(done)

    def is_completed(self) -> bool:
        return self._inner.is_completed() and not self._pairs


def _refuse(self: Any, name: str, args: tuple) -> None:
    for index, says in REFUSED.get(name, ()):
        if index < len(args) and _has_view(args[index]):
            raise V.fail(self._rank, name, f"a non-contiguous tensor was passed ({says}, as "
                         "gloo refuses it)", "pass tensor.contiguous()")


def _wrap(name: str, method: Callable) -> Callable:
    first_staged = name in STAGED or name in _STAGED_FIRST

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if not any(_has_view(a) for a in args):
            return method(self, *args, **kwargs)
        _refuse(self, name, args)
        if not first_staged:
            return method(self, *args, **kwargs)
        pairs: list = []
        staged = (_stage(args[0], pairs), *(_stage(a, None) for a in args[1:]))
        work = method(self, *staged, **kwargs)
        if work is None:  # a synchronous call that completed in the call: write back now
            for view, copy in pairs:
                view.copy_(copy)
            return None
        return WriteBackWork(work, pairs) if pairs else work

    return call


def _wrap_sparse(method: Callable) -> Callable:
    @functools.wraps(method)
    def allreduce(self, tensors, opts=None, **kwargs):
        t = tensors[0] if len(tensors) == 1 else None
        if t is None or not isinstance(t, torch.Tensor) or t.layout != torch.sparse_coo:
            return method(self, tensors, opts, **kwargs)
        return sparse_allreduce(self, t, tensors, opts)

    return allreduce


def sparse_allreduce(backend: Any, t: torch.Tensor, tensors: list, opts: Any) -> Any:
    """A SUM all_reduce of one sparse COO tensor, on the transport (gloo), in sequence order."""
    name = "all_reduce"
    op = V.op_type(getattr(opts, "reduceOp", ReduceOp.SUM))
    if op != ReduceOp.SUM:
        raise V.fail(backend._rank, name, f"{op} on a sparse COO tensor",
                     "gloo sums sparse tensors only: use ReduceOp.SUM, or reduce t.to_dense()")
    if t.device.type != "cpu":
        raise V.fail(backend._rank, name, f"a sparse tensor on {t.device}",
                     "sparse all_reduce runs on CPU (gloo): reduce t.cpu(), or t.to_dense()")
    return backend._eager(name, t.device, lambda tp: tp.allreduce(tensors, opts), tensors,
                          opts, None)


def conform(cls: type) -> type:
    """Class decorator: the collectives of a backend class accept what gloo accepts."""
    for name in (*STAGED, *REFUSED):
        method = cls.__dict__.get(name)
        if method is not None:
            setattr(cls, name, _wrap(name, method))
    cls.allreduce = _wrap_sparse(cls.allreduce)
    return cls
