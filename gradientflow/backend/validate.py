"""Argument checks for every collective: bad input becomes one sentence, never a hang."""
from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch._C._distributed_c10d import ReduceOp

from gradientflow.backend.dtypes import NOT_REDUCED
from gradientflow.errors import CollectiveError

_BITWISE = {ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR}
_ORDERED = {ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT}
SUPPORTED_DEVICES = ("cpu", "cuda")


def op_type(reduce_op) -> "ReduceOp.RedOpType":
    """The plain reduce-op type of a ReduceOp or RedOpType value."""
    return getattr(reduce_op, "op", reduce_op)


def _name(tensor: torch.Tensor, label: str) -> str:
    return f"{label} (dtype {tensor.dtype}, shape {tuple(tensor.shape)}, device {tensor.device})"


def fail(rank: int, op: str, what: str, fix: str) -> CollectiveError:
    """Build the error: rank, op, what is wrong, what to do."""
    return CollectiveError(f"gradientflow: rank {rank}: {op}: {what}. {fix}")


def check_tensor(rank: int, op: str, tensor, label: str = "tensor",
                 device: torch.device | None = None) -> None:
    """One tensor: a dense, contiguous tensor on a supported device (and on `device` if given)."""
    if not isinstance(tensor, torch.Tensor):
        raise fail(rank, op, f"{label} is a {type(tensor).__name__}, not a torch.Tensor",
                   "Pass tensors.")
    if tensor.layout != torch.strided:
        raise fail(rank, op, f"{_name(tensor, label)} is {tensor.layout}",
                   "gradientflow reduces dense tensors only: pass tensor.to_dense(), or "
                   "all_gather the indices and values of a sparse gradient")
    if tensor.device.type not in SUPPORTED_DEVICES:
        raise fail(rank, op, f"{_name(tensor, label)} is on an unsupported device",
                   "gradientflow runs CPU tensors over gloo and CUDA tensors over NCCL: move it "
                   "with .cpu() or .cuda()")
    if device is not None and tensor.device != device:
        raise fail(rank, op, f"{_name(tensor, label)} is not on {device} like the other tensors "
                   "of this call", "Put every tensor of one collective on the same device.")
    if not tensor.is_contiguous():
        raise fail(rank, op, f"{_name(tensor, label)} is not contiguous",
                   "Pass tensor.contiguous() (and copy the result back if you need it in place).")


def check_tensors(rank: int, op: str, tensors: Iterable, label: str = "tensor",
                  device: torch.device | None = None) -> torch.device | None:
    """Several tensors that must share one device; returns it."""
    for i, t in enumerate(tensors):
        check_tensor(rank, op, t, f"{label}[{i}]", device)
        device = t.device if device is None else device
    return device


def check_single(rank: int, op: str, tensors: Sequence) -> torch.Tensor:
    """The list form of a collective: gradientflow takes exactly one tensor per process."""
    if len(tensors) != 1:
        raise fail(rank, op, f"got {len(tensors)} tensors in the tensor list",
                   "gradientflow takes one tensor per process and call (multi-device lists are "
                   "not supported): issue one call per tensor")
    check_tensor(rank, op, tensors[0])
    return tensors[0]


_REDUCE_OK: set = set()  # (reduce-op number, dtype) pairs that passed check_reduce


def check_reduce(rank: int, op: str, tensor: torch.Tensor, reduce_op) -> None:
    """The reduce op must be defined for the dtype, with the same meaning on every rank."""
    dt = tensor.dtype
    # Every async allreduce passes here (161 per ResNet-50 step); comparing pybind enums costs
    # microseconds each, and the answer depends on (op, dtype) only. hash() of a ReduceOp or a
    # RedOpType is its op number, cheaper than reading the .op property.
    key = (hash(reduce_op), dt)
    if key in _REDUCE_OK:
        return
    kind = op_type(reduce_op)
    integral = not (dt.is_floating_point or dt.is_complex)
    if kind == ReduceOp.AVG and integral:
        raise fail(rank, op, f"ReduceOp.AVG on an integer tensor ({_name(tensor, 'tensor')})",
                   "an integer average would truncate: reduce with SUM and divide yourself, or "
                   "convert to a floating dtype")
    if kind in _BITWISE and not integral:
        raise fail(rank, op, f"bitwise {kind} on a {dt} tensor",
                   "BAND/BOR/BXOR are defined for integer and bool tensors only")
    if kind in _ORDERED and dt.is_complex:
        raise fail(rank, op, f"{kind} on a complex tensor ({_name(tensor, 'tensor')})",
                   "complex numbers have no order: use SUM or AVG, or reduce the real and "
                   "imaginary parts separately")
    if dt in NOT_REDUCED:
        raise fail(rank, op, f"{dt} tensors cannot be reduced ({_name(tensor, 'tensor')})",
                   "reduce a wider copy (tensor.float()) and convert the result back; "
                   "broadcasts, gathers and all-to-alls move any dtype")
    if kind == ReduceOp.PREMUL_SUM:
        raise fail(rank, op, "ReduceOp.PREMUL_SUM is not supported",
                   "multiply by the factor yourself and reduce with SUM")
    _REDUCE_OK.add(key)


def check_root(rank: int, op: str, root: int, world_size: int) -> None:
    """A root/peer rank must exist in the group."""
    if not 0 <= root < world_size:
        raise fail(rank, op, f"rank {root} is not in this group of {world_size} ranks",
                   f"use a group rank in [0, {world_size - 1}]")


def check_list_len(rank: int, op: str, items: Sequence, expected: int, label: str) -> None:
    """A per-rank list must have one entry per rank."""
    if len(items) != expected:
        raise fail(rank, op, f"{label} has {len(items)} entries for a group of {expected} ranks",
                   f"pass exactly {expected} tensors, one per rank")


def check_same_shape(rank: int, op: str, tensors: Sequence[torch.Tensor], ref: torch.Tensor,
                     label: str) -> None:
    """Every tensor of a per-rank list must match the local tensor's dtype and size."""
    for i, t in enumerate(tensors):
        if t.dtype != ref.dtype or t.numel() != ref.numel():
            raise fail(rank, op, f"{_name(t, f'{label}[{i}]')} does not match "
                       f"{_name(ref, 'the input')}",
                       "every entry must have the input's dtype and number of elements")


def check_rank_list(rank: int, op: str, lists, world_size: int, label: str,
                    ref: torch.Tensor) -> None:
    """The [[one tensor per rank]] argument of gather-like ops: one list, world_size entries,
    each on the reference tensor's device with its dtype and size."""
    if len(lists) != 1:
        raise fail(rank, op, f"expected one {label} list, got {len(lists)}",
                   f"pass {label} as one list of world_size tensors")
    check_list_len(rank, op, lists[0], world_size, label)
    check_tensors(rank, op, lists[0], label, ref.device)
    check_same_shape(rank, op, lists[0], ref, label)
