"""Collective algorithms for the allreduce of one flat message: ring, hierarchical,
reduction_server, auto (docs/ALGORITHMS.md): one module each, imported below, which attaches
what runs it to its entry in gradientflow/algorithm_registry.py.

The backend builds one `Algorithms` per process group and asks it for a `transport_for`
per transport stream (a *channel*: the engine's fused and stage messages, the solo channel).
What it returns stands in for the transport's own process group: its
`allreduce([tensor], opts)` returns a c10d Work, reduced under the group's algorithm.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from gradientflow import algorithm_registry as registry
from gradientflow.algorithm_registry import Algorithm, lookup, register
from gradientflow.algorithms import auto as _auto  # noqa: F401  (each attaches what runs it)
from gradientflow.algorithms import hierarchical as _hierarchical  # noqa: F401
from gradientflow.algorithms import reduction_server as _reduction_server  # noqa: F401
from gradientflow.algorithms import ring as _ring
from gradientflow.algorithms.base import (AlgorithmWork, Executor, StepFailed, algorithm_stats,
                                          reset_algorithm_stats)
from gradientflow.algorithms.topology import Topology, discover
from gradientflow.stores import own_connection

ALGORITHMS = registry.names()

__all__ = ["ALGORITHMS", "Algorithm", "Algorithms", "AlgorithmWork", "StepFailed", "Topology",
           "algorithm_stats", "lookup", "register", "reset_algorithm_stats"]


class Algorithms:
    """A process group's algorithm setting, its topology and its channels."""

    def __init__(self, config: Any, store, rank: int, size: int, timeout_s: float,
                 make_group: Callable[[Any, str, int, int, str], Any], label: str) -> None:
        """`make_group(store, device_type, rank, size, prefix)`: a transport group (gloo for
        "cpu", NCCL for "cuda") of `size` ranks meeting under `prefix` in `store` (a
        connection to the group's store)."""
        self.name = config.algorithm
        self.reducers = config.reducers
        self._config = config
        self.store = store
        self.rank = rank
        self.size = size
        self.timeout_s = timeout_s
        self._make_group = make_group
        self.label = label
        self._topo: Topology | None = None
        self._lock = threading.Lock()
        self._channels: list[Channel] = []
        lookup(self.name).check(config, rank)

    def topology(self) -> Topology:
        """Which ranks share a host (read through the store once, by every rank)."""
        with self._lock:
            if self._topo is None:
                # on a connection of its own: a thread creating a transport group on the
                # shared one may be waiting there for a peer that waits for this exchange
                self._topo = discover(own_connection(self.store), self.rank, self.size,
                                      self._config.host or self._config.node,
                                      self.timeout_s,
                                      local_world_size=self._config.local_world_size)
            return self._topo

    def group_maker(self) -> Callable[[str, int, int, str], Any]:
        """`make_group` for one channel's subgroups, which meet through a store connection of
        the channel's own: creating a group waits in the store for the other ranks, and a wait
        holds its connection (gradientflow/stores.py). On the group's shared one, two channels
        creating their groups in different orders on different ranks wait for each other until
        the store's timeout."""
        own: list = []

        def make(device_type: str, rank: int, size: int, prefix: str) -> Any:
            if not own:
                own.append(own_connection(self.store))
            return self._make_group(own[0], device_type, rank, size, prefix)

        return make

    def known_topology(self) -> Topology | None:
        """The topology if it is worth knowing for ring's counters: discovered when the
        hierarchy was asked for, or when a host was named or torchrun says ranks are spread
        over hosts (LOCAL_WORLD_SIZE below the group's size); else None."""
        if self._topo is None:
            # the same rule on every rank: init refuses ranks that disagree on it
            # (settings_check.spans_hosts), so no rank looks the hosts up alone
            c = self._config
            if c.host or 0 < c.local_world_size < self.size:
                return self.topology()
        return self._topo

    def channel(self, name: str, transport_for: Callable[[torch.device], Any]
                ) -> Callable[[torch.device], Any]:
        """`transport_for` of one channel: under ring the transport, with its bytes counted."""
        ch = Channel(self, name, transport_for)
        self._channels.append(ch)
        return ch.transport_for

    def transports(self, name: str, base: Any) -> "ChannelTransports":
        """A channel standing in for a `Transports` (the engine's solo channel takes one)."""
        return ChannelTransports(self.channel(name, base.get), base)

    def shutdown(self) -> None:
        for ch in self._channels:
            ch.shutdown()


class ChannelTransports:
    """`get(device)` through a channel; everything else (existing(), for the barrier) is the
    underlying Transports'."""

    def __init__(self, get: Callable[[torch.device], Any], base: Any) -> None:
        self._get = get
        self._base = base

    def get(self, device: torch.device) -> Any:
        # The transport is connected here, as the engine expects of get(): on the caller's
        # thread before it takes the engine's lock (the first rank there waits for the others).
        self._base.get(device)
        return self._get(device)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)


class _Bound:
    """A channel's stand-in for the transport of one device."""

    __slots__ = ("channel", "device")

    def __init__(self, channel: "Channel", device: torch.device) -> None:
        self.channel = channel
        self.device = device

    def allreduce(self, tensors, opts=None):
        return self.channel.allreduce(self.device, tensors, opts)

    def __getattr__(self, name: str) -> Any:
        # Every other collective (eager ones, barriers) is the transport's own.
        return getattr(self.channel.transport(self.device), name)


class Channel:
    """One transport stream of a group under its algorithm: an executor and a handler per
    algorithm it used (the registry's `build`), created at the first message that needs it."""

    def __init__(self, algos: Algorithms, name: str,
                 transport_for: Callable[[torch.device], Any]) -> None:
        self.algos = algos
        self.name = name
        self.transport = transport_for  # the transport's own process group, per device
        self._bound: dict[str, _Bound] = {}
        self._executor: Executor | None = None
        self._handlers: dict[str, Any] = {}
        # Held while a multi-group algorithm is built or hands a message to the executor, so
        # every message of the channel reaches it in the order the engine issued them.
        self.lock = threading.Lock()

    def transport_for(self, device: torch.device) -> _Bound:
        b = self._bound.get(device.type)
        if b is None:
            b = self._bound[device.type] = _Bound(self, device)
        return b

    def pick(self, tensor: torch.Tensor, opts: Any) -> str:
        """The algorithm for this message (a function of the call alone: same on every rank);
        ring.FALLBACK: the baseline, for a message the configured algorithm cannot carry."""
        a = self.algos
        algo = lookup(a.name)
        if algo.chooser:
            algo = lookup(algo.choose(a, tensor, opts))
        if a.size <= 1:
            return registry.BASELINE
        if not algo.carries(tensor, opts):
            # CUDA tensors, or an op or dtype the reducers do not implement: the baseline
            # carries it, counted apart so stats() shows what the algorithm did not take
            return _ring.FALLBACK
        return algo.name

    def executor(self) -> Executor:
        """The channel's thread for algorithms that wait on several groups in turn."""
        if self._executor is None:
            self._executor = Executor(f"{self.algos.label}-{self.name}-algorithm")
        return self._executor

    def allreduce(self, device: torch.device, tensors, opts=None):
        return self._handler(self.pick(tensors[0], opts)).allreduce(device, tensors, opts)

    def _handler(self, name: str) -> Any:
        handler = self._handlers.get(name)
        if handler is None:
            with self.lock:
                handler = self._handlers.get(name)
                if handler is None:
                    handler = (_ring.RingHandler(self, name) if name == _ring.FALLBACK
                               else lookup(name).build(self))
                    self._handlers[name] = handler
        return handler

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.close()
        for handler in self._handlers.values():
            stop = getattr(handler, "shutdown", None)
            if stop is not None:
                stop()
