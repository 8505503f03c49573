"""Configuration, resolved once: arguments, then GRADIENTFLOW_* environment, then a settings
file (GRADIENTFLOW_CONFIG, e.g. one written by gradientflow.autotune), then defaults.

This is the only module that reads the environment. Everything else receives a frozen `Config`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Mapping

from gradientflow import algorithm_registry

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}

ENV_PREFIX = "GRADIENTFLOW_"
# Fields whose environment name is not ENV_PREFIX + the field's name in capitals.
_ENV_NAMES = {"config_file": "GRADIENTFLOW_CONFIG"}
CONFIG_FILE_VERSION = 1


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


CUDA_TRANSPORTS = ("nccl", "gloo")


def _parse_choice(value: Any, name: str, choices: tuple[str, ...]) -> str:
    s = str(value).strip().lower()
    if s not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}")
    return s


def _torchrun_host(environ: Mapping[str, str]) -> str:
    """This rank's host key: torchrun numbers a node's ranks RANK - LOCAL_RANK onwards, so that
    first rank names the node (two torchrun nodes on one machine stay two hosts)."""
    import socket

    name = socket.gethostname()
    try:
        return f"{name}/{int(environ['RANK']) - int(environ['LOCAL_RANK'])}"
    except (KeyError, ValueError):
        return name


def rendezvous_endpoint(environ: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """The workers' store as (host, port) from MASTER_ADDR/MASTER_PORT, else None (reducers)."""
    environ = os.environ if environ is None else environ
    if "MASTER_ADDR" in environ and "MASTER_PORT" in environ:
        return environ["MASTER_ADDR"], _parse_int(environ["MASTER_PORT"], "MASTER_PORT", 1,
                                                  65535)
    return None


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
    # Threads of the numba compression kernels per rank; 0: the cores divided among the ranks
    # of this host (torchrun's LOCAL_WORLD_SIZE, else the group's size), at least 1: ranks that
    # share cores must not oversubscribe them.
    kernel_threads: int = 0
    # Ranks on this host, from torchrun's LOCAL_WORLD_SIZE (0: unknown).
    local_world_size: int = 0
    # The transport under CUDA tensors: "nccl", or "gloo", which takes CUDA tensors for the
    # collectives DDP needs and, unlike NCCL, lets several ranks share one GPU.
    cuda_transport: str = "nccl"
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
    # A settings file (JSON, written by gradientflow.autotune or by hand) read below the
    # environment and explicit options (GRADIENTFLOW_CONFIG; "" none).
    config_file: str = ""

    # --- autotune (gradientflow/autotune; docs/AUTOTUNE.md) ---
    # Search the engine's settings during the first steps of training (rank 0 decides).
    autotune: bool = False
    # JSON-lines log of every trial and of the final choice ("" none); {rank} is substituted.
    autotune_log: str = ""
    # Where the chosen settings are written, for a later run's GRADIENTFLOW_CONFIG ("" none).
    autotune_out: str = ""
    # Trials (the defaults are the first), steps measured per trial, steps discarded first:
    # with 2 confirmation rounds, (12 + 4) * (1 + 4) + 1 = 81 steps, within 100.
    autotune_trials: int = 12
    autotune_steps: int = 4
    autotune_warmup: int = 1
    # Seed of the sampler, and which one: "tpe" (optuna's TPE) or "gp" (its Gaussian process).
    autotune_seed: int = 0
    autotune_sampler: str = "tpe"

    # --- collective algorithms (gradientflow/algorithms, docs/ALGORITHMS.md) ---
    # How fused messages and compressed stage messages are allreduced: ring (the transport's
    # own allreduce), hierarchical (reduce in each host, allreduce across one rank per host,
    # broadcast in each host), reduction_server (shards through `reducers` reducer
    # processes), auto (per message, by the cost model in algorithms/auto.py).
    algorithm: str = "ring"
    # Reducer processes serving this job (python -m gradientflow.reducer --reducers R); 0: none.
    reducers: int = 0
    # This rank's host for the hierarchy ("": `node` below).
    host: str = ""
    # Resolved, not an option: torchrun's node as the machine's name and RANK - LOCAL_RANK,
    # so the ranks of one torchrun node share a host (the machine's name alone without it).
    node: str = ""

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
            "kernel_threads": lambda v, n: _parse_int(v, n, 0, 1024),
            "local_world_size": lambda v, n: _parse_int(v, n, 0, 1 << 20),
            "cuda_transport": lambda v, n: _parse_choice(v, n, CUDA_TRANSPORTS),
            "debug": _parse_bool,
            "stall_warning_s": lambda v, n: _parse_float(v, n, 0.0, 86400.0),
            "stall_abort_s": lambda v, n: _parse_float(v, n, 0.0, 86400.0),
            "inspect_interval_s": lambda v, n: _parse_float(v, n, 0.0, 3600.0),
            "timeline": lambda v, n: str(v),
            "config_file": lambda v, n: str(v),
            "autotune": _parse_bool,
            "autotune_log": lambda v, n: str(v),
            "autotune_out": lambda v, n: str(v),
            "autotune_trials": lambda v, n: _parse_int(v, n, 1, 10000),
            "autotune_steps": lambda v, n: _parse_int(v, n, 1, 10000),
            "autotune_warmup": lambda v, n: _parse_int(v, n, 0, 10000),
            "autotune_seed": lambda v, n: _parse_int(v, n, 0, 2**31 - 1),
            "autotune_sampler": lambda v, n: _parse_choice(v, n, ("tpe", "gp")),
            "algorithm": lambda v, n: _parse_choice(v, n, algorithm_registry.names()),
            "reducers": lambda v, n: _parse_int(v, n, 0, 4096),
            "host": lambda v, n: str(v),
        }

    @staticmethod
    def env_name(field: str) -> str:
        """The environment variable of option `field`."""
        return _ENV_NAMES.get(field, ENV_PREFIX + field.upper())

    def replace(self, **changes: Any) -> "Config":
        """A copy with `changes` applied, each validated like an explicit option."""
        parsers = self._parsers()
        parsed = {}
        for field, value in changes.items():
            if field not in parsers:
                raise ValueError(f"unknown gradientflow option {field!r}: valid options are "
                                 f"{', '.join(sorted(parsers))}")
            parsed[field] = parsers[field](value, field)
        return dataclasses.replace(self, **parsed)

    @classmethod
    def resolve(cls, overrides: Mapping[str, Any] | None = None,
                environ: Mapping[str, str] | None = None) -> "Config":
        """Build the config. Highest first: explicit overrides, GRADIENTFLOW_* variables, the
        settings file (the `config_file` option, else GRADIENTFLOW_CONFIG), defaults.

        The file sits below the environment so that one variable can still try another value
        on top of a tuned file. Raises ValueError naming the variable, option or file entry
        and its valid range; an unknown GRADIENTFLOW_* variable is an error too (a typo would
        otherwise be silently ignored).
        """
        environ = os.environ if environ is None else environ
        parsers = cls._parsers()
        values: dict[str, Any] = {}
        path = (overrides or {}).get("config_file") or environ.get(_ENV_NAMES["config_file"])
        if path:
            values.update(read_config_file(str(path))["settings"])
        known_env = {cls.env_name(f) for f in parsers}
        for key in environ:
            if key.startswith(ENV_PREFIX) and key not in known_env:
                raise ValueError(
                    f"unknown environment variable {key}: gradientflow knows "
                    f"{', '.join(sorted(known_env))}"
                )
        for field, parse in parsers.items():
            env_name = cls.env_name(field)
            if env_name in environ:
                values[field] = parse(environ[env_name], env_name)
        values["node"] = _torchrun_host(environ)
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


# Options a settings file may not hold: where files are, and whether to tune (a tuned file
# must not start another search).
_NOT_IN_FILE = {"config_file", "autotune", "autotune_log", "autotune_out"}


def read_config_file(path: str) -> dict[str, Any]:
    """Read a settings file: {"gradientflow_config": 1, "settings": {...}, ...}.

    Returns the document with "settings" parsed (values validated like options). Other keys
    (an "autotune" summary) are returned as they are. Raises ValueError naming the file.
    """
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as exc:
        raise ValueError(f"GRADIENTFLOW_CONFIG={path!r} cannot be read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"GRADIENTFLOW_CONFIG={path!r} is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("gradientflow_config") != CONFIG_FILE_VERSION:
        raise ValueError(f"GRADIENTFLOW_CONFIG={path!r} is not a gradientflow settings file "
                         f'(expected an object with "gradientflow_config": {CONFIG_FILE_VERSION}'
                         ' and "settings")')
    parsers = Config._parsers()
    settings = {}
    for field, value in dict(doc.get("settings") or {}).items():
        if field not in parsers or field in _NOT_IN_FILE:
            allowed = sorted(set(parsers) - _NOT_IN_FILE)
            raise ValueError(f"GRADIENTFLOW_CONFIG={path!r}: unknown setting {field!r}; a "
                             f"settings file may hold {', '.join(allowed)}")
        settings[field] = parsers[field](value, f"{path}: {field}")
    return {**doc, "settings": settings}


def write_config_file(path: str, settings: Mapping[str, Any],
                      extra: Mapping[str, Any] | None = None) -> None:
    """Write `settings` (validated) to `path` for a later run's GRADIENTFLOW_CONFIG.

    Written to a temporary file then renamed, so a reader never sees half a file.
    """
    Config().replace(**settings)  # validate before anything is written
    doc = {"gradientflow_config": CONFIG_FILE_VERSION, "settings": dict(settings),
           **dict(extra or {})}
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


_user_overrides: dict[str, Any] = {}


def configure(**options: Any) -> Config:
    """Set options for process groups created from now on (validated at once); returns them
    resolved."""
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
