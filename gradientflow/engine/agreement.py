"""The agreement rounds' arithmetic: pure functions of what a rank has locally.

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

from typing import Sequence

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
