"""Residuals of an FSDP compression checkpoint carried to another mesh, their mass kept.

What a residual holds is gradient not yet applied. Its share of the averaged gradient is

    M_p = sum over ranks of (reduce-scatter residual) / (shards x replicas)
        + sum over replicas of (replicate all-reduce residual) / replicas

per parameter p, once each rank's pieces are put back in place (the pieces are rows of p, padded
to a multiple of the shard count, as FSDP pads them). On the new mesh every rank is given M_p
(its pieces of it, padded the new way): on a replicate all-reduce where there is one (each
replica holds its shard of M_p, whose average is M_p), else on the reduce-scatter (each rank
holds all of M_p, whose average is M_p). Nothing is lost or counted twice; only how it is split
among the ranks changes, so which chunks are sent next may differ from a run that never moved.
"""
from __future__ import annotations

import torch

__all__ = ["reshard_units"]


def _place(pieces: dict[int, torch.Tensor], count: int) -> torch.Tensor:
    """Stack piece 0..count-1 (dim 0) into the padded whole; a missing piece is zeros."""
    like = next(iter(pieces.values()))
    return torch.cat([pieces.get(j, torch.zeros_like(like)).double() for j in range(count)])


def _mass(saved: dict, unit_name: str, shapes: dict[str, tuple[int, ...]]
          ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """M_p of every parameter of one unit (unpadded, float64), and each parameter's residual
    learning rate where the checkpoint has one."""
    replicas, shards = (int(x) for x in saved["mesh"])
    mass: dict[str, torch.Tensor] = {}
    lrs: dict[str, float] = {}

    def add(name: str, value: torch.Tensor) -> None:
        rows = shapes[name][0] if shapes[name] else 1
        value = value.reshape(-1, *shapes[name][1:])[:rows] if shapes[name] else value.reshape(())
        mass[name] = mass[name] + value if name in mass else value.clone()

    ar_by_replica: dict[str, dict[int, dict[int, torch.Tensor]]] = {}
    for entry in saved["ranks"]:
        r, s = entry["coord"]
        unit = entry["units"].get(unit_name, {})
        for key, state in unit.items():
            for name, lr in (state.get("residual_lr") or {}).items():
                lrs.setdefault(name.rsplit("#", 1)[0] if key == "rs" else name, float(lr))
            residual = state.get("memory", {}).get("residual", {})
            if key == "ar":
                for name, t in residual.items():
                    ar_by_replica.setdefault(name, {}).setdefault(r, {})[s] = t
            else:
                per: dict[str, dict[int, torch.Tensor]] = {}
                for piece, t in residual.items():
                    name, j = piece.rsplit("#", 1)
                    per.setdefault(name, {})[int(j)] = t
                for name, pieces in per.items():
                    add(name, _place(pieces, shards) / (shards * replicas))
    for name, by_r in ar_by_replica.items():
        for pieces in by_r.values():
            add(name, _place(pieces, shards) / replicas)
    return mass, lrs


def _pieces(whole: torch.Tensor, piece_shape: tuple[int, ...], count: int) -> list[torch.Tensor]:
    """`whole` padded with zero rows to `count` pieces of `piece_shape`, cut into them."""
    rows = piece_shape[0] if piece_shape else 1
    flat = whole.reshape(-1, *piece_shape[1:]) if piece_shape else whole.reshape(1)
    pad = rows * count - flat.shape[0]
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, *flat.shape[1:])])
    return [p.reshape(piece_shape).float().clone() for p in flat.split(rows)]


def reshard_units(saved: dict, units, shard_rank: int,
                  shapes: dict[str, tuple[int, ...]]) -> dict[str, dict[str, dict]]:
    """The residual memory and learning rates each of this rank's compressors loads:
    {unit name: {"rs" | "ar": {"memory": ..., "residual_lr": ...}}}.

    `units`: this rank's units (fsdp_comms.Unit); `shapes`: each parameter's full shape.
    """
    out: dict[str, dict[str, dict]] = {}
    for unit in units:
        mass, lrs = _mass(saved, unit.name, shapes)
        piece_shape = dict(zip(unit.shard_layout.names, unit.shard_layout.shapes))
        count = len(unit.full_layout.names) // max(1, len(unit.shard_layout.names))
        target = "ar" if unit.ar is not None else ("rs" if unit.rs is not None else None)
        if target is None:
            continue
        residual, rates = {}, {}
        for name, whole in mass.items():
            pieces = _pieces(whole, piece_shape[name], count)
            if target == "ar":
                residual[name] = pieces[shard_rank]
                if name in lrs:
                    rates[name] = lrs[name]
            else:
                for j, piece in enumerate(pieces):
                    residual[f"{name}#{j}"] = piece
                    if name in lrs:
                        rates[f"{name}#{j}"] = lrs[name]
        out[unit.name] = {target: {"memory": {"residual": residual} if residual else {},
                                   "residual_lr": rates}}
    return out
