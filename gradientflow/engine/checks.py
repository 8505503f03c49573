"""What every rank must agree on before a collective that is not fused moves any data.

A deferred allreduce is checked by its batch's agreement round (agreement.py: dtype, every
dimension, reduce op). Every other collective, the eager ones, gets a round of its own on the
same side group, in issue order, before it reaches the transport: the round carries the
fingerprint of its signature (`Check`), so a rank that issued something else (another op, a
dtype, a dimension, a root, a reduce op, or a deferred allreduce where the others issued an
eager op) is found on every rank at once and the call is refused with the group still usable.
All-to-all, whose sizes may differ between ranks, then has a second round (`pair_word`): what
each rank sends to each other must be what that rank expects.

Pure: the rounds themselves run in rounds.py.
"""
from __future__ import annotations

import functools
import zlib
from typing import Any, Iterator

import torch

from torch._C._distributed_c10d import ReduceOp

from gradientflow.errors import CollectiveMismatchError
from gradientflow.fingerprint import describe as _describe, mix, redop_name

# Collectives whose outputs differ between ranks by design, and what of them is compared:
# gather's list exists on the root only; all-to-all's per-rank tensors may have any sizes.
_SIG_ONLY = frozenset({"gather"})
_DTYPES_ONLY = frozenset({"all_to_all"})
_ROWS_FREE = frozenset({"all_to_all_single"})
_PAIR_BITS = 40
_PAIR_MASK = (1 << _PAIR_BITS) - 1


class Check:
    """One eager collective as an agreement round's candidate (`seq`, `fingerprint`,
    `describe()`), with what each rank sends and expects for all-to-all (`pairs`), and the
    tensor of an allreduce or a broadcast that may travel inside its round (`payload`, see
    `inband_cap`; `summed`: it did, and the peers' were added, or the root's copied:
    rounds.check)."""

    __slots__ = ("seq", "key", "fingerprint", "pairs", "waited", "payload", "route", "summed")

    def __init__(self, seq: int, key: tuple, pairs: Any = None, waited: bool = False,
                 payload: torch.Tensor | None = None, route: int = 0) -> None:
        self.seq = seq
        self.key = key
        # A call on a route of its own (INBAND, EXCHANGE) differs from the same call on the
        # transport's: ranks that would take different routes are refused before either sends.
        fp = key_fingerprint(key)
        self.fingerprint = mix(fp, route) if route else fp
        self.pairs = pairs  # () -> (bytes sent to each rank, bytes expected from each rank)
        self.waited = waited  # a synchronous call: its caller blocks on it
        self.payload = payload
        self.route = route
        self.summed = False

    @classmethod
    def known(cls, seq: int, key: tuple, fingerprint: int, waited: bool,
              payload: torch.Tensor | None, route: int) -> "Check":
        """A Check whose `fingerprint` (of `key` on `route`, as __init__ computes it) is
        already known: a caller that caches it saves hashing the key on every call."""
        chk = cls.__new__(cls)
        chk.seq = seq
        chk.key = key
        chk.fingerprint = fingerprint
        chk.pairs = None
        chk.waited = waited
        chk.payload = payload
        chk.route = route
        chk.summed = False
        return chk

    def describe(self) -> str:
        return f"#{self.seq} {describe_key(self.key)}{_ROUTE_NAMES.get(self.route, '')}"


# Eager SUMs of two ranks on CPU take routes of their own, which give gloo's bits because
# each rank adds the other's tensor to its own (a + b on one, b + a on the other: floating-
# point addition commutes; with more ranks the order of the sum would differ from gloo's):
# - INBAND, up to 4 KiB: the tensor travels inside its own check round (exchange.py), one
#   exchange instead of a round and then the transport's allreduce. 4 KiB because every round
#   of a group of two sends a frame of that size, whether it carries a payload or not.
# - EXCHANGE, up to 4 MiB: after the round, one all-to-all of the whole tensor on the transport
#   (one hop each way, where gloo's ring of two takes two in a row, each of half the bytes);
#   or inside the round, when the last two rounds agreed an exchanged call of its size
#   (rounds.py): a repeated call then costs one exchange, as an in-band one does.
#
# A broadcast of two ranks on CPU up to 64 KiB is CARRIED: the root's tensor travels in the
# call's check round and the other rank copies it from there (gloo's bits: the root's bytes),
# one exchange instead of a round and then the transport's broadcast. DDP broadcasts its
# buffers (BatchNorm's statistics) before every forward: a few KiB, once or twice a step. The
# round has room for it when a broadcast of that size was agreed not long before (rounds.py).
INBAND, EXCHANGE, CARRIED = 1, 2, 3
_ROUTE_NAMES = {INBAND: " (in its check round)", EXCHANGE: " (exchanged whole)",
                CARRIED: " (carried in its check round)"}
INBAND_BYTES = 4096
EXCHANGE_BYTES = 4 * 2**20
CARRY_BYTES = 64 * 1024
_OWN_ROUTE_DTYPES = frozenset({torch.float32, torch.float64, torch.int32, torch.int64})
_SUM = hash(ReduceOp.SUM)


def inband_cap(world_size: int) -> int:
    """The payload room of a round of a group of `world_size` (0: none), unless the rounds
    before it agreed a larger one (rounds.Rounds._cap)."""
    return INBAND_BYTES if world_size == 2 else 0


def own_route(tensor: torch.Tensor, reduce_op: Any, world_size: int) -> int:
    """INBAND, EXCHANGE or 0 (the transport's allreduce) for an eager allreduce: a function of
    what the round compares (dtype, size, reduce op) and the world size, so a rank that decides
    otherwise than its peers sends another fingerprint and the call is refused."""
    if (world_size != 2 or tensor.dtype not in _OWN_ROUTE_DTYPES or hash(reduce_op) != _SUM
            or tensor.device.type != "cpu" or tensor.layout != torch.strided):
        return 0
    nbytes = tensor.numel() * tensor.element_size()
    return INBAND if nbytes <= INBAND_BYTES else EXCHANGE if nbytes <= EXCHANGE_BYTES else 0


def broadcast_route(tensor: torch.Tensor, world_size: int) -> int:
    """CARRIED or 0 (the transport's broadcast) for an eager broadcast: a function of what the
    round compares (dtype, size) and the world size, as own_route is for an allreduce."""
    if world_size != 2 or tensor.device.type != "cpu" or tensor.layout != torch.strided:
        return 0
    return CARRIED if tensor.numel() * tensor.element_size() <= CARRY_BYTES else 0


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for item in x:
            yield from _tensors(item)


def signature(name: str, sig: torch.Tensor | None, outputs: Any, root: Any,
              reduce_op: Any) -> tuple:
    """The key of a collective: what every rank must pass alike (hashable, no tensors)."""
    head = (sig.dtype, tuple(sig.shape)) if isinstance(sig, torch.Tensor) else None
    if name in _SIG_ONLY:
        outs: tuple = ()
    elif name in _DTYPES_ONLY:
        outs = tuple(sorted({str(t.dtype) for t in _tensors(outputs)}))
    elif name in _ROWS_FREE:
        outs = tuple((t.dtype, tuple(t.shape[1:])) for t in _tensors(outputs))
    else:
        outs = tuple((t.dtype, tuple(t.shape)) for t in _tensors(outputs))
    r = -1 if root is None else int(root)
    op = None if reduce_op is None else redop_name(reduce_op)
    return (name, head, outs, r, op)


@functools.lru_cache(maxsize=4096)
def key_fingerprint(key: tuple) -> int:
    """A process-independent fingerprint of a signature key (CRC-32 of its repr, cached: a
    program repeats the same few signatures)."""
    return zlib.crc32(repr(key).encode())


def describe_key(key: tuple) -> str:
    """The signature as a sentence fragment: op, dtype and shape, root, reduce op, outputs."""
    name, head, outs, root, op = key
    text = _describe(name, head, root if root >= 0 else None, op)
    if outs and (head is None or any(o != head for o in outs)):
        parts = [o if isinstance(o, str) else
                 f"{str(o[0]).replace('torch.', '')} {o[1]}" for o in outs]
        text += " -> " + ", ".join(parts[:4]) + (" ..." if len(parts) > 4 else "")
    return text


def _pair_hash(src: int, dst: int, nbytes: int) -> int:
    s = f"{src}>{dst}:{nbytes}".encode()
    return ((zlib.crc32(s) << 8) ^ zlib.crc32(s[::-1])) & _PAIR_MASK


def pair_word(rank: int, send: list, recv: list) -> int:
    """This rank's word of the all-to-all pair round: SUM-allreduced over the ranks, it is
    0 modulo 2**40 when what each rank sends to each other is what that rank expects (and
    otherwise with probability 2**-40)."""
    out = sum(_pair_hash(rank, j, int(b)) for j, b in enumerate(send))
    into = sum(_pair_hash(j, rank, int(b)) for j, b in enumerate(recv))
    return (out - into) & _PAIR_MASK


def pairs_agree(total: int) -> bool:
    """Whether the SUM of every rank's pair_word says the sizes pair up."""
    return total & _PAIR_MASK == 0


def refuses_only_the_call(err: BaseException, refusable: bool) -> bool:
    """Whether a round's error refuses only its call, alike on every rank, the group usable.

    The rule of both places an eager call's round runs (the caller's thread, Issue._settle;
    the engine thread, jobs.EagerOp): a mismatch the round refused on every rank, for a call
    nothing of which was sent yet (`refusable`); anything else fails the group.
    """
    return (refusable and isinstance(err, CollectiveMismatchError)
            and bool(getattr(err, "refused", None)))
