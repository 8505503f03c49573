"""One way for the ranks of a group to check that they agree on something they each describe.

Each rank describes what must agree (its settings, its optimizer plan, the call it is about to
issue) as a string. `agree` exchanges a fixed-size digest of the description (SHA-256, 128 bits:
one small message whatever the description's size); only when the digests differ, which every
rank sees alike, are the descriptions themselves gathered, so every rank can name what each
rank holds. The caller turns that into its own error (what to do differs per check);
`Disagreement.ranks_holding` and `sentence` give the common part.

The exchange is the caller's: the group's own collectives (`GroupExchange`), the store through
rank 0 (`StoreExchange`, before a group's transport exists), or anything with the two methods of
`Exchange`. A check whose exchange must also carry data (autotune's rows) decodes every rank's
description from what it gathered and calls `disagreement` directly.

The engine's agreement rounds (engine/rounds.py) are a different mechanism: per batch, on the
hot path, two MIN words instead of a digest.
"""
from __future__ import annotations

import datetime
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch
import torch.distributed as dist

__all__ = ["DIGEST_WORDS", "Disagreement", "Exchange", "GroupExchange", "StoreExchange",
           "agree", "digest_words", "disagreement"]

DIGEST_WORDS = 2  # int64 words of a digest: 128 bits, collisions out of reach


def digest_words(description: str) -> list[int]:
    """The digest of `description`: DIGEST_WORDS signed int64 words of its SHA-256."""
    raw = hashlib.sha256(description.encode()).digest()
    return [int.from_bytes(raw[8 * i:8 * i + 8], "little", signed=True)
            for i in range(DIGEST_WORDS)]


class Exchange(Protocol):
    """How one check's ranks exchange: each method returns every rank's value, rank order."""

    def digests(self, words: list[int]) -> list[list[int]]: ...

    def descriptions(self, description: str) -> list[str]: ...


@dataclass(frozen=True)
class Disagreement:
    """Every rank's description of what had to agree, seen from rank `rank`."""

    rank: int
    descriptions: tuple[str, ...]

    def ranks_holding(self) -> dict[str, list[int]]:
        """Each distinct description and the ranks that hold it, in order of first holder."""
        out: dict[str, list[int]] = {}
        for r, d in enumerate(self.descriptions):
            out.setdefault(d, []).append(r)
        return out

    def other(self) -> int:
        """A rank whose description differs from this rank's (rank 0's view if none does)."""
        mine = self.descriptions[self.rank]
        return next((r for r, d in enumerate(self.descriptions) if d != mine), 0)

    def sentence(self) -> str:
        """'ranks 0, 2: <description>; rank 1: <description>'."""
        return "; ".join(f"{'ranks' if len(rs) > 1 else 'rank'} {', '.join(map(str, rs))}: {d}"
                         for d, rs in self.ranks_holding().items())


def disagreement(descriptions: Sequence[str], rank: int) -> Disagreement | None:
    """None if every rank's description is the same, else what each rank holds."""
    if all(d == descriptions[0] for d in descriptions):
        return None
    return Disagreement(rank, tuple(descriptions))


def agree(description: str, exchange: Exchange, rank: int) -> Disagreement | None:
    """Exchange the digest of `description`; None if all ranks agree, else every rank's
    description (the same answer on every rank, so every rank raises or none does)."""
    words = digest_words(description)
    if all(w == words for w in exchange.digests(words)):
        return None
    # Every rank saw the same digests, so every rank gathers the descriptions.
    return disagreement(exchange.descriptions(description), rank)


class GroupExchange:
    """The exchange on a torch.distributed group: an int64 all_gather of the digests, and an
    object all_gather of the descriptions on a mismatch. Ordered collectives of the group:
    every rank must reach the check at the same point of its collectives."""

    def __init__(self, group: Any, world_size: int) -> None:
        self.group, self.world_size = group, world_size

    def digests(self, words: list[int]) -> list[list[int]]:
        mine = torch.tensor(words, dtype=torch.int64)
        out = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self.group)
        return [o.tolist() for o in out]

    def descriptions(self, description: str) -> list[str]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, description, group=self.group)
        return [str(d) for d in out]


class StoreExchange:
    """The exchange through a c10d store, for checks made before the group's transport exists.

    Every rank writes its value; rank 0 reads them all and writes the list once, which the
    others read: 2n store operations, not n^2. Keys live under `prefix`.
    """

    def __init__(self, store: Any, prefix: str, rank: int, size: int, timeout_s: float) -> None:
        self.store, self.prefix, self.rank, self.size = store, prefix, rank, size
        self.timeout = datetime.timedelta(seconds=timeout_s)

    def _allgather(self, name: str, value: str) -> list[str]:
        key = f"{self.prefix}{name}/"
        self.store.set(f"{key}{self.rank}", value)
        if self.rank == 0:
            keys = [f"{key}{r}" for r in range(self.size)]
            self.store.wait(keys, self.timeout)
            values = [self.store.get(k).decode() for k in keys]
            self.store.set(f"{key}all", json.dumps(values))
            return values
        self.store.wait([f"{key}all"], self.timeout)
        return json.loads(self.store.get(f"{key}all").decode())

    def digests(self, words: list[int]) -> list[list[int]]:
        return [json.loads(v) for v in self._allgather("digest", json.dumps(words))]

    def descriptions(self, description: str) -> list[str]:
        views = self._allgather("views", description)
        # Every rank raises next. Rank 0 hosts the store under init_method tcp:// and env://:
        # if it raised and exited first, the others would read "Connection reset" instead.
        if self.rank == 0:
            try:
                self.store.wait([f"{self.prefix}read/{r}" for r in range(1, self.size)],
                                datetime.timedelta(seconds=5))
            except Exception:  # noqa: BLE001 - raise the disagreement regardless
                pass
        else:
            self.store.set(f"{self.prefix}read/{self.rank}", "1")
        return views
