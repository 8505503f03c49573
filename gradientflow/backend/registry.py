"""Which gradientflow backend serves which process group (by group name).

Strong references: torch's TORCH_DISTRIBUTED_DEBUG=DETAIL wrapper needs the backend kept alive
by its creator, and `pg._get_backend()` returns the wrapper then, so this registry is how the
rest of gradientflow reaches its own backend.
"""
from __future__ import annotations

import threading
from typing import Any

_BACKENDS: dict[str, Any] = {}
_LOCK = threading.Lock()


def add(name: str, backend: Any) -> None:
    """Register `backend` as the one serving the group named `name`."""
    with _LOCK:
        _BACKENDS[name] = backend


def remove(name: str, backend: Any) -> None:
    """Forget `backend` (if it still serves `name`: a new group may reuse the name)."""
    with _LOCK:
        if _BACKENDS.get(name) is backend:
            del _BACKENDS[name]


def backends() -> list:
    """Every live gradientflow backend of this process."""
    with _LOCK:
        return list(_BACKENDS.values())


def backend_of(group: Any = None) -> Any:
    """The gradientflow backend of `group` (default: the world group), or None.

    Its `config` is the group's resolved Config, `engine` its engine, `inspector` its
    check-ins.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    pg = group if group is not None else dist.group.WORLD
    return _BACKENDS.get(str(pg.group_name))


def config_of(group: Any = None) -> Any:
    """The resolved Config of a gradientflow `group`, or None on other backends."""
    backend = backend_of(group)
    return None if backend is None else backend.config
