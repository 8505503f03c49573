"""The agreement rounds' arithmetic: pure functions of what a rank has locally.

Two kinds of round. The sequence engine's (below first) closes a batch of deferred
allreduces; the keyed scheduler's (round_bits, read_bits) agrees which partitions are ready
on every rank.

Each batch of deferred allreduces is closed by one round on the agreement group: every rank
contributes two int64 words, MIN-allreduced, from which every rank reads the same batch end
and whether the ranks queued the same allreduces (rounds.py runs it; plan_messages in
fusion.py then cuts the agreed batch into messages with no further talk). Every other
collective's round is the same with one candidate, its signature (checks.py); a third word,
whether the caller blocks on the candidates, decides whether a mismatch only refuses them.

Words: `(k << 40) | f` and `((MAX_BATCH - k) << 40) | (2**40 - 1 - f)`, where k is this
rank's candidate count and f the fingerprint of its k candidates (dtype, every dimension,
reduce op, chained from the batch's first sequence number). The MIN of the first word is the
smallest k with the smallest fingerprint among the ranks at that k; the second gives the
largest k with the largest fingerprint. Two words and not a fingerprint per candidate prefix: a gloo
allreduce of 1-2 elements costs a fraction of one of 6 or more at 4 ranks (its ring then
wakes every rank several times).
"""
from __future__ import annotations

from typing import Iterable, Sequence

from gradientflow.fingerprint import mix

MAX_BATCH = 256  # most deferred ops one agreement round can close (fits the words' 9 bits)
_FP_BITS = 40  # the round's words: (ops << 40) | 40-bit fingerprint
_FP_MASK = (1 << _FP_BITS) - 1


def batch_fingerprint(ops: Sequence) -> int:
    """The fingerprint of a batch's ops (dtype, size, reduce op), chained from its first
    sequence number, so ranks whose batches start at different operations differ too."""
    h = ops[0].seq
    for op in ops:
        h = mix(h, op.fingerprint)
    return h


def round_words(k: int, fingerprint: int) -> list[int]:
    """A rank's two words for the agreement round: k candidates, their fingerprint."""
    f = fingerprint & _FP_MASK
    return [(k << _FP_BITS) | f, ((MAX_BATCH - k) << _FP_BITS) | (_FP_MASK - f)]


def read_round(a: int, b: int) -> tuple[int, int, int, int]:
    """The MIN-allreduced round words as (smallest k, largest k, lo, hi): lo is the smallest
    fingerprint among the ranks at the smallest k, hi the largest among those at the largest
    k (so, when every rank has the same k, the smallest and largest of all)."""
    return (a >> _FP_BITS, MAX_BATCH - (b >> _FP_BITS), a & _FP_MASK,
            _FP_MASK - (b & _FP_MASK))


def verdict(k: int, n: int, lo: int, hi: int) -> str | None:
    """What a round read on `k` local candidates says is wrong, or None: the first n of them
    are then the agreed batch. "range": n does not fall inside this rank's candidates;
    "fingerprints": the ranks queued different allreduces."""
    if not 1 <= n <= k:
        return "range"
    return "fingerprints" if lo != hi else None


# ------------------------------------------------------------------ keyed rounds
MAX_KEYS = 1024  # most partitions one step may declare (the round carries one bit per key)
_BITS = 63  # bits used per int64 word of a keyed round (the sign bit stays clear)


def round_bits(n: int, ready: Iterable[int], done: int, span: int) -> list[int]:
    """A rank's keyed round as int64 words to BAND-allreduce.

    Bit k < n is set iff key k is ready here. The next `span` bits hold `done` in a thermometer
    code (its lowest `done` bits set): the AND of such codes over the ranks is the code of the
    smallest count, so one BAND carries both the AND of the ready bits and the MIN of the
    counts. `span` must be the same on every rank (the scheduler uses the launches not yet
    agreed complete, a function of the rounds processed so far).

    Bits, not a slot per key: like the sequence engine's two words, a gloo allreduce of a
    word or two costs a fraction of one of 10 or more at 4 ranks.
    """
    if not 0 <= done <= span:
        raise ValueError(f"round_bits: completion count {done} outside [0, {span}]")
    x = ((1 << done) - 1) << n
    for k in ready:
        x |= 1 << k
    words = max(1, -(-(n + span) // _BITS))
    mask = (1 << _BITS) - 1
    return [(x >> (_BITS * i)) & mask for i in range(words)]


def read_bits(words: Iterable[int], n: int, span: int) -> tuple[int, int]:
    """The BAND-reduced words of round_bits as (ready mask: bit k set iff key k is ready on
    every rank, the smallest completion count)."""
    x = 0
    for i, w in enumerate(words):
        x |= int(w) << (_BITS * i)
    code = (x >> n) & ((1 << span) - 1)
    return x & ((1 << n) - 1), ((code + 1) & ~code).bit_length() - 1
