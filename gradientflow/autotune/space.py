"""The settings autotune searches, their ranges, and how a trial's values become settings.

Pure (no optuna import): the tuner on rank 0 turns each `Param` into an optuna distribution;
every rank uses `encode`/`decode` to carry a trial's values in one float64 vector (exact for
the integers involved, all below 2**53; a choice travels as its index). Density is not here on
purpose: it changes accuracy, so it stays the user's choice.

Where a setting lives (`Param.target`): "engine" settings are fields of the group's Config,
swapped by GradientFlowBackend.reconfigure; "compression" settings (the CSC chunk size) belong
to a DDP hook state's CompressionConfig, changed through the state's setter.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from gradientflow import algorithm_registry as registry
from gradientflow.fingerprint import text_fingerprint


@dataclasses.dataclass(frozen=True)
class Param:
    """One tuned setting: its range (or its `choices`), log scale or not, its type and where
    it lives ("engine": a Config field; "compression": the hook state's CompressionConfig)."""

    name: str
    low: float = 0.0
    high: float = 0.0
    log: bool = True
    integer: bool = True
    choices: tuple[str, ...] = ()
    target: str = "engine"

    def clip(self, value: float) -> Any:
        """`value` in range, rounded to an int where the field is one (a choice: by index)."""
        if self.choices:
            return self.choices[min(max(int(round(float(value))), 0), len(self.choices) - 1)]
        v = min(max(float(value), self.low), self.high)
        return int(round(v)) if self.integer else v

    def to_float(self, value: Any) -> float:
        """The float that carries `value` (a choice's index)."""
        return float(self.choices.index(value)) if self.choices else float(value)


# Ranges: a decade or more either side of each default (config.py says why the defaults are
# what they are); fusion segments 1-4 (more only cost memory on a 2-message pipeline). The cycle
# stops at 10 ms: while messages are in flight the queue waits 5 cycles before it cuts, so
# 10-20 ms only adds 50-100 ms of latency to a step's last batch, and on a log scale that
# region would take a sixth of a dozen-trial search.
PARAMS: dict[str, Param] = {p.name: p for p in (
    Param("fusion_threshold", 2**20, 256 * 2**20),
    Param("solo_threshold", 2**18, 64 * 2**20),
    Param("cycle_time_ms", 0.25, 10.0, integer=False),
    Param("fusion_segments", 1, 4, log=False),
    # CSC chunk size: 256-4096 elements around the 1024 default (compression/config.py says
    # why 1024), only with a compression state to apply it to. The chunk is the unit CSC
    # selects, so, like density, it moves accuracy: the range is the one whose accuracy was
    # measured (experiments/imagenet/results/sweep: 256, 1024 and 4096 at 1% within 1.6 points
    # on digits); coarser chunks are left to the user.
    Param("chunk_size", 256, 4096, target="compression"),
    # The collective algorithm: its choices are those the group's topology offers
    # (algorithm_choices); only tuned where there are two that differ.
    Param("algorithm", choices=registry.choice_order()),
)}
# Tuned unless the caller names others: the chunk size is added when the tuner is given a
# compression state, the algorithm where the topology offers a choice.
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


def algorithm_choices(num_hosts: int, max_ranks_per_host: int, reducers: int) -> tuple[str, ...]:
    """The algorithms that can differ on this topology, ring first (one entry: no choice):
    each says where it differs (gradientflow/algorithm_registry.py); auto joins where two do."""
    return registry.offered(num_hosts, max_ranks_per_host, reducers)


def with_choices(param: Param, choices: Sequence[str]) -> Param:
    """`param` restricted to `choices` (kept in `param`'s order)."""
    return dataclasses.replace(param, choices=tuple(c for c in param.choices if c in choices))


def encode(params: Sequence[Param], values: Mapping[str, Any]) -> list[float]:
    """`values` as floats in `params`' order."""
    return [p.to_float(values[p.name]) for p in params]


def decode(params: Sequence[Param], vector: Sequence[float]) -> dict[str, Any]:
    """The settings a vector from `encode` carries, typed and in range."""
    return {p.name: p.clip(v) for p, v in zip(params, vector)}


def settings_id(*parts: Any) -> int:
    """The CRC-32 of `parts` (their repr; exact in a float64 row): the tuner's settings, which
    the ranks compare at every exchange."""
    return int(text_fingerprint(repr(parts)), 16)
