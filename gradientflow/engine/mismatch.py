"""The sentences of an eager collective's mismatch, from every rank's view of it (pure: the
views are gathered by rounds.py)."""
from __future__ import annotations

from gradientflow.engine.checks import Check
from gradientflow.errors import CollectiveMismatchError
from gradientflow.fingerprint import text_fingerprint


def eager_mismatch(rank: int, group: str, chk: Check, views: list,
                   refusable: bool = True) -> CollectiveMismatchError:
    """The error of an eager collective that another rank issued differently: `views`, every
    rank's description of its call, by rank (not `refusable`: some rank did not wait for its
    round, and the group fails)."""
    mine = views[rank]
    other = next((r for r, v in enumerate(views) if v != mine), rank)

    def said(r: int) -> str:
        v = views[r]
        text = "; ".join(s.split(" ", 1)[1] if s.startswith("#") else s for s in v)
        if len(v) > 1:
            text = f"async allreduces: {text}"
        return f"{text} [fingerprint {text_fingerprint(text)}]"

    return CollectiveMismatchError(
        f"gradientflow: rank {rank}: collective mismatch at sequence number {chk.seq} on "
        f"process group {group}: rank {rank} issued {said(rank)}, rank {other} issued "
        f"{said(other)}. Every rank must issue the same collectives (op, dtype, every "
        "dimension, root, reduce op) in the same order; "
        + ("the call was refused on every rank before any data moved." if refusable
           else "no rank took another's data, and since not every rank waited for the round "
           "(an asynchronous call; the root of an asynchronous broadcast sends its tensor and "
           "goes on), the group is failed.")
        + "".join(f"\n  rank {r}: {'; '.join(v)}" for r, v in enumerate(views)))


def pairs_mismatch(rank: int, group: str, chk: Check, send: list, recv: list,
                   views: list | None) -> CollectiveMismatchError:
    """All-to-all sizes that do not pair up: name the pairs (`views`: every rank's [bytes
    sent to each rank, bytes expected from each], by rank; None if they could not be
    gathered)."""
    bad = []
    if views is not None:
        w = len(views)
        bad = [(i, j, views[i][0][j], views[j][1][i]) for i in range(w) for j in range(w)
               if views[i][0][j] != views[j][1][i]]
    pairs = "; ".join(f"rank {i} sends {sb} bytes to rank {j}, which expects {rb}"
                      for i, j, sb, rb in bad[:8]) or "the sizes do not pair up"
    err = CollectiveMismatchError(
        f"gradientflow: rank {rank}: collective mismatch at sequence number {chk.seq} on "
        f"process group {group}: {chk.key[0]} sizes disagree between ranks: "
        f"{pairs}{' ...' if len(bad) > 8 else ''}. Make each rank's input split sizes match "
        "the output split sizes of the ranks it sends to; the call was refused on every rank "
        "before any data moved.")
    err.refused = 1
    return err
