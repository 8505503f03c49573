"""The settings autotune searches, their ranges, and how a trial's values become a Config.

Pure (no optuna import): the tuner on rank 0 turns each `Param` into an optuna distribution;
every rank uses `encode`/`decode` to carry a trial's values in one float64 vector (exact for
the integers involved, all below 2**53). Density is not here on purpose: it changes accuracy,
so it stays the user's choice.
"""
from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Param:
    """One tuned Config field: its range, whether it is searched on a log scale, its type."""

    name: str
    low: float
    high: float
    log: bool = True
    integer: bool = True

    def clip(self, value: float) -> Any:
        """`value` in range, rounded to an int where the field is one."""
        v = min(max(float(value), self.low), self.high)
        return int(round(v)) if self.integer else v


# Ranges: a decade or more either side of each default (config.py says why the defaults are
# what they are); fusion segments 1-4 (more only cost memory on a 2-message pipeline).
PARAMS: dict[str, Param] = {p.name: p for p in (
    Param("fusion_threshold", 2**20, 256 * 2**20),
    Param("solo_threshold", 2**18, 64 * 2**20),
    Param("cycle_time_ms", 0.25, 20.0, integer=False),
    Param("fusion_segments", 1, 4, log=False),
    Param("schedule_credit", 2**18, 64 * 2**20),
)}
# Tuned unless the caller names others: the scheduler's credit only matters where the keyed
# scheduler runs (DistributedOptimizer), so it is searched there only.
DEFAULT_PARAMS = ("fusion_threshold", "solo_threshold", "cycle_time_ms", "fusion_segments")


def params_of(names: Sequence[str | Param] | None) -> tuple[Param, ...]:
    """The Params named (default DEFAULT_PARAMS); a Param given as such sets its own range.

    Raises ValueError for a setting that is not tunable.
    """
    items = DEFAULT_PARAMS if names is None else tuple(names)
    out = tuple(p if isinstance(p, Param) else PARAMS.get(p, Param(str(p), 0, 0))
                for p in items)
    unknown = [p.name for p in out if p.name not in PARAMS]
    if unknown or not out:
        raise ValueError(f"autotune: cannot tune {unknown or 'nothing'}; tunable settings are "
                         f"{', '.join(PARAMS)} (density is never tuned: it changes accuracy)")
    return out


def encode(params: Sequence[Param], values: Mapping[str, Any]) -> list[float]:
    """`values` as floats in `params`' order."""
    return [float(values[p.name]) for p in params]


def decode(params: Sequence[Param], vector: Sequence[float]) -> dict[str, Any]:
    """The settings a vector from `encode` carries, typed and in range."""
    return {p.name: p.clip(v) for p, v in zip(params, vector)}


def fingerprint(*parts: Any) -> int:
    """A 32-bit hash of `parts` (their repr), exact in a float64: ranks compare theirs."""
    return zlib.crc32(repr(parts).encode())
