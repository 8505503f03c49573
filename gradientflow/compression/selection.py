"""Chunk selection over several buckets at once: one quota for the pool, or one per bucket.

CSC reducing one bucket alone sends the top ceil(density x chunks) of that bucket, so which
chunks travel depends on how DDP cut the model into buckets (bucket_cap_mb). Given the reduced
chunk norms of every bucket of one fused batch together, `select_pool` can instead choose the
top chunks across all of them ("pool"): the chosen chunks are then the same however the pool
is cut into buckets (at chunk boundaries). "bucket" keeps the per-bucket quota.

Pure functions of the reduced norms (the same on every rank, so every rank selects alike);
`select_pool_reference` is the pure-torch reference the property tests compare against.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from gradientflow import kernels

__all__ = ["QUOTAS", "select_pool", "select_pool_reference", "bucket_quota", "pool_quota"]

QUOTAS = ("pool", "bucket")


def bucket_quota(nchunks: int, density: float) -> int:
    """Chunks one bucket of `nchunks` sends at `density` (at least one; CSC's per-bucket quota)."""
    return min(nchunks, max(1, math.ceil(density * nchunks))) if nchunks else 0


def pool_quota(nchunks: Sequence[int], density: float) -> int:
    """Chunks a pool of buckets sends at `density`: the quota of their chunks taken together."""
    return bucket_quota(sum(nchunks), density)


def _check(norms: Sequence[torch.Tensor], density: float, quota: str,
           eligible: Sequence[bool] | None) -> list[bool]:
    if quota not in QUOTAS:
        raise ValueError(f"select_pool: quota={quota!r} must be one of {QUOTAS}")
    if not (0.0 < float(density) <= 1.0):
        raise ValueError(f"select_pool: density={density!r} must be in (0, 1]")
    for i, n in enumerate(norms):
        if n.dim() != 1 or not n.is_floating_point():
            raise ValueError(f"select_pool: norms[{i}] must be a 1-D floating tensor, got "
                             f"{n.dtype} of shape {tuple(n.shape)}")
    if eligible is None:
        return [True] * len(norms)
    if len(eligible) != len(norms):
        raise ValueError(f"select_pool: eligible has {len(eligible)} entries for {len(norms)} "
                         "buckets; give one per bucket")
    return [bool(e) for e in eligible]


def select_pool(norms: Sequence[torch.Tensor], density: float, *, quota: str = "pool",
                eligible: Sequence[bool] | None = None) -> list[torch.Tensor]:
    """Return, per bucket, the indices of its chunks to send (int64, ascending).

    Args:
        norms: each bucket's reduced chunk norms (the same on every rank).
        density: the fraction of chunks to send.
        quota: "pool" chooses the top pool_quota(...) chunks across every eligible bucket
            (ties to the earlier bucket, then the lower chunk; NaN ranks first); "bucket"
            chooses bucket_quota(...) chunks in each bucket, as CSC does for one bucket.
        eligible: per bucket, whether it has chunks worth sending (a bucket of dense
            parameters only has none); default all. Under "pool" every bucket's chunks count
            towards the quota, as the chunks of dense parameters do inside one bucket, so a
            batch selects as one bucket holding all its parameters would.
    """
    ok = _check(norms, density, quota, eligible)
    empty = [torch.zeros(0, dtype=torch.int64, device=n.device) for n in norms]
    if quota == "bucket":
        return [kernels.select_chunks(n, bucket_quota(n.numel(), density)) if e else z
                for n, e, z in zip(norms, ok, empty)]
    live = [i for i, e in enumerate(ok) if e and norms[i].numel()]
    if not live:
        return empty
    pool = torch.cat([norms[i].to(torch.float32) for i in live])
    k = min(pool.numel(), pool_quota([n.numel() for n in norms], density))
    chosen = kernels.select_chunks(pool, k)  # ascending positions in the pool
    out = list(empty)
    start = 0
    for i in live:
        end = start + norms[i].numel()
        bounds = torch.tensor([start, end], device=chosen.device)
        lo, hi = torch.searchsorted(chosen, bounds).tolist()
        out[i] = chosen[lo:hi] - start
        start = end
    return out


def select_pool_reference(norms: Sequence[torch.Tensor], density: float, *, quota: str = "pool",
                          eligible: Sequence[bool] | None = None) -> list[torch.Tensor]:
    """The pure-torch reference of `select_pool`: an explicit ranking of (norm, bucket, chunk)."""
    ok = _check(norms, density, quota, eligible)
    out = [torch.zeros(0, dtype=torch.int64) for _ in norms]
    if quota == "bucket":
        groups = [([i], bucket_quota(norms[i].numel(), density)) for i, e in enumerate(ok) if e]
    else:
        groups = [([i for i, e in enumerate(ok) if e], pool_quota([n.numel() for n in norms],
                                                                  density))]
    for members, k in groups:
        entries = []
        for b in members:
            for c, v in enumerate(norms[b].to(torch.float32).tolist()):
                entries.append((math.inf if math.isnan(v) else v, b, c))
        entries.sort(key=lambda t: (-t[0], t[1], t[2]))
        for b in members:
            picked = sorted(c for _, bb, c in entries[:k] if bb == b)
            out[b] = torch.tensor(picked, dtype=torch.int64)
    return out
