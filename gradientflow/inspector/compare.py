"""What the check-ins say: the first collective two ranks issued differently.

Pure: it compares this rank's history (descriptors and fingerprint chain) with the peers'
check-ins as read from the store; the inspector decides when to read and what to do.
"""
from __future__ import annotations

from gradientflow.errors import CollectiveMismatchError
from gradientflow.fingerprint import DEFERRED, text_fingerprint


def first_mismatch(rank: int, name: str, hist: list, marks: list,
                   peers: dict[int, dict | None], kept: int, refused: set | None = None,
                   chain_upto: int | None = None,
                   below: int | None = None) -> CollectiveMismatchError | None:
    """The first sequence number at which another rank issued a different collective, as the
    error to raise, or None.

    `hist`: this rank's [seq, n, chain, descriptor] records (the newest `kept`); `marks`: its
    (n, seq, chain) checkpoints; `peers`: the other ranks' check-ins (None: never checked in).
    A differing descriptor at a common sequence number is named; failing that, two chains
    that differ at a common count n mean the calls differed at or before n, older than the
    history. Calls an agreement round refused on every rank (`refused`, and each peer's) are
    not compared, nor the chains from the count of the first refused call on (`chain_upto`);
    with `below`, only sequence numbers below it are.
    """
    mine = {seq: desc for seq, _n, _h, desc in hist}
    chain = {n: (seq, h) for seq, n, h, _d in hist}
    chain.update({n: (seq, h) for n, seq, h in marks})
    first = None
    diverged = None
    for r, c in peers.items():
        if not c:
            continue
        skip = set(refused or ()) | set(c.get("refused") or ())
        upto = min((u for u in (chain_upto, c.get("chain_upto")) if u is not None),
                   default=None)
        for seq, _n, _h, desc in c["hist"]:
            if seq in skip or (below is not None and seq >= below):
                continue
            if seq in mine and mine[seq] != desc and (first is None or seq < first[0]):
                first = (seq, r, desc)
        theirs = {n: (seq, h) for seq, n, h, _d in c["hist"]}
        theirs.update({n: (seq, h) for n, seq, h in c.get("marks", [])})
        common = sorted(n for n in set(chain) & set(theirs)
                        if (upto is None or n < upto)
                        and (below is None or chain[n][0] < below))
        bad = [n for n in common if chain[n][1] != theirs[n][1]]
        if bad and diverged is None:
            good = [n for n in common if n < bad[0]]
            diverged = (r, chain[good[-1]][0] if good else None, chain[bad[0]][0],
                        chain[bad[0]][1], theirs[bad[0]][1])
    if first is None and diverged is not None:
        r, lo, hi, h_mine, h_theirs = diverged
        return CollectiveMismatchError(
            f"gradientflow: rank {rank}: collective mismatch on process group "
            f"{name}: rank {rank} and rank {r} issued different collectives "
            f"{'after sequence number %d and ' % lo if lo is not None else ''}at or before "
            f"sequence number {hi} (fingerprint chains {h_mine & 0xffffffff:08x} vs "
            f"{h_theirs & 0xffffffff:08x} there; the calls themselves are older than the "
            f"{kept} this rank keeps). Every rank must issue the same collectives (op, "
            "dtype, shape, root, reduce op) in the same order; set GRADIENTFLOW_DEBUG=1 to "
            "stop at the first differing call.")
    if first is None:
        return None
    seq, r, desc = first
    hint = ""
    if diverged is not None and diverged[2] < seq:
        hint += (f" (The calls already differed at or before sequence number {diverged[2]}, "
                 "older than the history kept.)")
    if mine[seq].replace(DEFERRED, "") == desc.replace(DEFERRED, ""):
        hint += (" The calls differ only in whether gradientflow deferred them for fusion, "
                 "which follows from async_op for allreduces between sync_fusion_limit and "
                 "the fusion threshold: issue this allreduce with the same async_op on every "
                 "rank.")
    return CollectiveMismatchError(
        f"gradientflow: rank {rank}: collective mismatch at sequence number {seq} on "
        f"process group {name}: rank {rank} issued {mine[seq]} [fingerprint "
        f"{text_fingerprint(mine[seq])}], rank {r} issued {desc} [fingerprint "
        f"{text_fingerprint(desc)}]. "
        "Every rank must issue the same collectives (op, dtype, shape, root, reduce op) in "
        "the same order; collectives issued from several threads, or only on some ranks, "
        "break that. Set GRADIENTFLOW_DEBUG=1 to check every call before it is sent." + hint)
