"""Configuration, resolved once: arguments, then GRADIENTFLOW_* environment, then defaults.

This is the only module that reads the environment. Everything else receives a frozen `Config`.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Mapping

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}

ENV_PREFIX = "GRADIENTFLOW_"


def parse_size(value: Any, name: str = "size") -> int:
    """Parse a byte count: an int, or a string such as '64MB', '4MiB', '1048576'."""
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected a byte count such as 64MB, got {value!r}")
    if isinstance(value, int):
        out = value
    else:
        m = _SIZE_RE.match(str(value))
        if not m or (m.group(2) or "").lower() not in _UNITS:
            raise ValueError(
                f"{name}={value!r} is not a byte count: use an integer number of bytes or a "
                "suffix such as 64MB, 16MiB, 512KB (0 disables)"
            )
        out = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if out < 0:
        raise ValueError(f"{name}={value!r} must be >= 0 bytes")
    return out


def _parse_bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise ValueError(f"{name}={value!r} is not a boolean: use 1/0, true/false, on/off")


def _parse_float(value: Any, name: str, lo: float, hi: float) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} is not a number; valid range [{lo}, {hi}]") from None
    if not lo <= out <= hi:
        raise ValueError(f"{name}={value!r} is out of range; valid range [{lo}, {hi}]")
    return out


def _parse_int(value: Any, name: str, lo: int, hi: int) -> int:
    try:
        out = int(str(value).strip()) if not isinstance(value, int) else value
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer; valid range [{lo}, {hi}]") from None
    if isinstance(value, bool) or not lo <= out <= hi:
        raise ValueError(f"{name}={value!r} is out of range; valid range [{lo}, {hi}]")
    return out


@dataclasses.dataclass(frozen=True)
class Config:
    """Backend configuration: one frozen value per process group, passed down to every layer."""

    # --- tuned by the user ---
    # Largest fused message in bytes; 0 disables fusion. 128 MiB (Horovod's default): with the
    # solo threshold below, the best or near it on bench_fusion's model lists, where smaller
    # thresholds start a round for every threshold's worth of queued tensors.
    fusion_threshold: int = 128 * 2**20
    # Tensors at least this big are sent alone, in place (no copy into a fusion buffer and
    # back), while the fused message of the smaller ones goes on around them; 0: the fusion
    # threshold. 4 MB: ResNet-50's 4.19 MB layer4 weights go in place too, which bench_fusion
    # measures at least as fast as larger values; smaller ones add messages for no gain.
    solo_threshold: int = 4 * 10**6
    # CPU: allreduces of at least the solo threshold go at once, on the caller's thread, over
    # a second gloo group (engine/issue.py says why no agreement is needed), so they leave
    # during the issuing loop as DDP's buckets do. CUDA keeps its solos in the batch (one
    # NCCL communicator).
    solo_channel: bool = True
    # Synchronous allreduces smaller than this are deferred (and agreed) like async ones,
    # because PyTorch's Join pairs a synchronous allreduce on one rank with an async one on
    # another; 256 B covers Join's one-element flags without making every small synchronous
    # allreduce pay a round.
    sync_fusion_limit: int = 256
    # Persistent fusion buffers per queue (device, dtype, op): packing message i+1 overlaps
    # the transport of message i. Extra memory <= segments * threshold per active queue.
    fusion_segments: int = 2
    # Horovod's cycle time: how long the caller must have been quiet before a partial batch's
    # round starts (a wait(), flush(), the threshold or another collective starts it at once;
    # engine/queue.py has the rule). 0 sends whatever is queued as soon as the transport falls
    # idle, which sends most tensors alone. 3 ms, not 1: a per-tensor loop of 161 allreduces
    # takes 5-10 ms to issue on a loaded machine, and must not be cut into several rounds.
    cycle_time_ms: float = 3.0
    # Priority scheduling (DistributedOptimizer): ByteScheduler's credit, the bytes in flight,
    # as agreed by the rounds at each ready partition and each completed transfer (at least 3
    # transfers are always allowed: 2 in flight beat 1 and all at once, a 3rd covers the round
    # that frees the credit).
    schedule_credit: int = 4 * 10**6
    # Threads of the numba compression kernels per rank; 0: the cores divided among the ranks
    # of this host (torchrun's LOCAL_WORLD_SIZE, else the group's size), at least 1: ranks that
    # share cores must not oversubscribe them.
    kernel_threads: int = 0
    # Ranks on this host, from torchrun's LOCAL_WORLD_SIZE (0: unknown).
    local_world_size: int = 0
    # Full collective checks (every collective fingerprinted, not only fused batches).
    debug: bool = False
    # Seconds a collective may wait before a stall warning (0 disables) / an abort (0 disables).
    stall_warning_s: float = 60.0
    stall_abort_s: float = 0.0
    # How often each rank checks in to the store (its recent collectives) and, while one of its
    # collectives is pending, reads the others' check-ins for a mismatch or a stall (0 disables;
    # then only fused batches are checked). Off the hot path: a background thread per group.
    inspect_interval_s: float = 1.0
    # Chrome-trace timeline path ("" disables); {rank} is substituted.
    timeline: str = ""

    # Fields, their env names and parsers, in one table so validation is uniform.
    @staticmethod
    def _parsers() -> dict[str, Any]:
        return {
            "fusion_threshold": lambda v, n: parse_size(v, n),
            "solo_threshold": lambda v, n: parse_size(v, n),
            "solo_channel": _parse_bool,
            "sync_fusion_limit": lambda v, n: parse_size(v, n),
            "fusion_segments": lambda v, n: _parse_int(v, n, 1, 8),
            "cycle_time_ms": lambda v, n: _parse_float(v, n, 0.0, 1000.0),
            "schedule_credit": lambda v, n: parse_size(v, n),
            "kernel_threads": lambda v, n: _parse_int(v, n, 0, 1024),
            "local_world_size": lambda v, n: _parse_int(v, n, 0, 1 << 20),
            "debug": _parse_bool,
            "stall_warning_s": lambda v, n: _parse_float(v, n, 0.0, 86400.0),
            "stall_abort_s": lambda v, n: _parse_float(v, n, 0.0, 86400.0),
            "inspect_interval_s": lambda v, n: _parse_float(v, n, 0.0, 3600.0),
            "timeline": lambda v, n: str(v),
        }

    @classmethod
    def resolve(cls, overrides: Mapping[str, Any] | None = None,
                environ: Mapping[str, str] | None = None) -> "Config":
        """Build the config: explicit overrides win over GRADIENTFLOW_* variables over defaults.

        Raises ValueError naming the variable or option and its valid range; an unknown
        GRADIENTFLOW_* variable is an error too (a typo would otherwise be silently ignored).
        """
        environ = os.environ if environ is None else environ
        parsers = cls._parsers()
        values: dict[str, Any] = {}
        known_env = {ENV_PREFIX + f.upper() for f in parsers}
        for key in environ:
            if key.startswith(ENV_PREFIX) and key not in known_env:
                raise ValueError(
                    f"unknown environment variable {key}: gradientflow knows "
                    f"{', '.join(sorted(known_env))}"
                )
        for field, parse in parsers.items():
            env_name = ENV_PREFIX + field.upper()
            if env_name in environ:
                values[field] = parse(environ[env_name], env_name)
        if "LOCAL_WORLD_SIZE" in environ and "local_world_size" not in values:
            values["local_world_size"] = parsers["local_world_size"](
                environ["LOCAL_WORLD_SIZE"], "LOCAL_WORLD_SIZE")
        for field, value in (overrides or {}).items():
            if field not in parsers:
                raise ValueError(
                    f"unknown gradientflow option {field!r}: valid options are "
                    f"{', '.join(sorted(parsers))}"
                )
            if value is not None:
                values[field] = parsers[field](value, field)
        return cls(**values)


_user_overrides: dict[str, Any] = {}


def configure(**options: Any) -> Config:
    """Set options for process groups created from now on (validated at once); returns them resolved."""
    cfg = Config.resolve({**_user_overrides, **options})
    _user_overrides.update({k: v for k, v in options.items() if v is not None})
    return cfg


def current_overrides() -> dict[str, Any]:
    """The options set by `configure()` so far."""
    return dict(_user_overrides)


def kernel_threads(config: Config, world_size: int, cores: int | None = None) -> int:
    """Threads each rank's compression kernels should use under `config` (at least 1): its
    kernel_threads, else the kernels' own rule for the ranks sharing this host's cores."""
    if config.kernel_threads:
        return config.kernel_threads
    from gradientflow.kernels import threads_per_rank  # (numba: only where kernels run)

    return threads_per_rank(max(1, config.local_world_size or world_size), cores)


def restart_attempt(environ: Mapping[str, str] | None = None) -> str | None:
    """torchrun's restart count of this worker (TORCHELASTIC_RESTART_COUNT), or None.

    Not a gradientflow setting, so not in Config: it namespaces the store per attempt.
    """
    environ = os.environ if environ is None else environ
    return environ.get("TORCHELASTIC_RESTART_COUNT") or None
