"""Process-independent fingerprints of collectives, shared by every check that compares ranks.

Python's str hash is salted per process, so nothing here uses it: names and dtypes are
CRC-32'd, and running fingerprints are folded with `mix`. The agreement round (engine), the
check-ins (inspector), the debug check and autotune's settings id all hash through this module,
so two ranks compare like with like. A fingerprint here is always a CRC (or a fold of CRCs);
checks that compare whole descriptions exchange a SHA-256 digest instead (cross_rank.py).
"""
from __future__ import annotations

import functools
import zlib
from typing import Any

MASK = 2**61 - 1  # running fingerprints stay below 2**61 (they travel as int64)
_IDS: dict = {}


def mix(h: int, x: int) -> int:
    """Fold fingerprint `x` into running fingerprint `h` (deterministic across processes)."""
    return ((h * 1_000_003) ^ x) & MASK


def name_id(x: Any) -> int:
    """A process-independent id of an op name or a dtype (CRC-32 of its str, cached)."""
    v = _IDS.get(x)
    if v is None:
        v = _IDS[x] = zlib.crc32(str(x).encode())
    return v


@functools.lru_cache(maxsize=4096)
def tensor_fingerprint(dtype: Any, shape: tuple, op: Any) -> int:
    """What must match across ranks for one fused allreduce: dtype, every dimension, reduce
    op number (Horovod refuses an allreduce whose shapes differ even where the sizes agree).

    Cached: a training step repeats the same few hundred (dtype, shape, op) every step.
    """
    return zlib.crc32(f"{dtype}|{tuple(shape)}|{op}".encode())


def text_fingerprint(desc: str) -> str:
    """A short fingerprint of a descriptor string (CRC-32, 8 hex digits)."""
    return f"{zlib.crc32(desc.encode()):08x}"


def redop_name(op: Any) -> str:
    """The plain name of a ReduceOp or RedOpType value ('SUM', 'MAX', ...); '' for None."""
    if op is None:
        return ""
    return str(getattr(op, "op", op)).rsplit(".", 1)[-1]


DEFERRED = " (deferred)"  # the name suffix of an allreduce queued for fusion


def describe(name: str, tensor: Any, root: Any, reduce_op: Any) -> str:
    """The descriptor of one collective: what every rank must issue identically.

    `tensor`: (dtype, shape) as recorded on the hot path, or None.
    """
    parts = [name]
    if isinstance(tensor, tuple):
        parts.append(f"{str(tensor[0]).replace('torch.', '')} {tuple(tensor[1])}")
    if root is not None and root >= 0:
        parts.append(f"root {root}")
    if reduce_op is not None:
        parts.append(redop_name(reduce_op))
    return " ".join(parts)
