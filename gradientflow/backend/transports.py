"""The transports under the engine: torch's own process groups, one per device type.

gloo for CPU tensors, NCCL for CUDA tensors (created lazily on first CUDA use, on the same
store), each adapted (adapter.py: every dtype, a future on every Work). gradientflow never
writes sockets.
"""
from __future__ import annotations

import datetime
import threading
from typing import Any, Callable

import torch
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo

from gradientflow.backend.adapter import adapted
from gradientflow.config import restart_attempt
from gradientflow.stores import own_connection


def make_gloo(store, rank: int, size: int, timeout: datetime.timedelta, prefix: str):
    return ProcessGroupGloo(PrefixStore(prefix, store), rank, size, timeout)


def make_nccl(store, rank: int, size: int, timeout: datetime.timedelta, prefix: str):
    from torch._C._distributed_c10d import ProcessGroupNCCL

    opts = ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return ProcessGroupNCCL(PrefixStore(prefix, store), rank, size, opts)


def attempt_store(store):
    """The store namespaced by torchrun's restart count: one attempt never reads another's keys.

    Under `torchrun --max-restarts` the agent's store outlives the workers, and a restarted
    attempt gets the same store with the same group name. Without a namespace, gloo's
    rendezvous reads the dead attempt's addresses ("Connection refused" at init), and the
    inspector would adopt the dead attempt's fault.
    """
    attempt = restart_attempt()
    return PrefixStore(f"gradientflow/attempt{attempt}/", store) if attempt else store


def incarnation_store(store, size: int):
    """The store namespaced by this group's incarnation, counted in the store itself.

    A group destroyed and made again under the same name on the same store (hvd.shutdown()
    then hvd.init(); destroy_process_group() then init_process_group(): torch's multi-tenant
    TCPStore server outlives its groups while anything holds it) would otherwise read the
    keys of the one before: gloo's rendezvous would connect to its dead addresses, the
    inspector would adopt its fault. Every rank adds one at each creation, and the ranks of
    one incarnation all add before any of them can make the next (its transports connect all
    of them first), so each rank reads the same incarnation.
    """
    n = store.add("gradientflow/incarnations", 1)
    return PrefixStore(f"gradientflow/inc{(n - 1) // size}/", store)


class Transports:
    """The transport process group per device type; CUDA's is created on first use.

    Groups created on first use meet through a store connection of their own
    (gradientflow/stores.py): their rendezvous runs on whichever thread first needs them,
    while other threads of the rank may be waiting in the store.
    """

    # Factories are class attributes so tests can substitute fakes for the CUDA path.
    factories: dict[str, Callable[..., Any]] = {"cpu": adapted(make_gloo),
                                                "cuda": adapted(make_nccl)}

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta,
                 prefix: str = "gradientflow/", connect_cpu: bool = True) -> None:
        self._store = store
        self._peers = (rank, size, timeout)  # the factories' arguments after the store
        self._prefix = prefix
        self._by_type: dict[str, Any] = {}
        self._lock = threading.Lock()
        if connect_cpu:  # gloo eagerly: connecting it is part of init, on the group's connection
            self._create("cpu", store)

    def existing(self, device_type: str) -> Any:
        """The transport for `device_type` if it was created, else None."""
        return self._by_type.get(device_type)

    def get(self, device: torch.device) -> Any:
        """The transport for `device`, created on first use (on a store connection of its
        own)."""
        pg = self._by_type.get(device.type)
        if pg is None:
            with self._lock:
                pg = self._by_type.get(device.type)
                if pg is None:
                    pg = self._create(device.type, own_connection(self._store))
        return pg

    def _create(self, device_type: str, store) -> Any:
        factory = self.factories.get(device_type)
        if factory is None:
            raise RuntimeError(f"gradientflow has no transport for {device_type}")
        pg = self._by_type[device_type] = factory(store, *self._peers,
                                                  f"{self._prefix}{device_type}/")
        return pg

    def created(self) -> list[str]:
        return sorted(self._by_type)

    def shutdown(self) -> None:
        for pg in self._by_type.values():
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
