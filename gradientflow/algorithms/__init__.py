"""Collective algorithms for the allreduce of one flat message: ring, hierarchical,
reduction_server, auto (docs/ALGORITHMS.md).

The backend builds one `Algorithms` per process group and asks it for a `transport_for`
per transport stream (a *channel*: the engine's fused and stage messages, the solo channel).
What it returns stands in for the transport's own process group: its
`allreduce([tensor], opts)` returns a c10d Work, reduced under the group's algorithm.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from gradientflow.algorithms import auto as _auto
from gradientflow.algorithms import ring as _ring
from gradientflow.algorithms.base import (AlgorithmWork, Executor, StepFailed, algorithm_stats,
                                          reset_algorithm_stats)
from gradientflow.algorithms.topology import Topology, discover

from gradientflow.config import ALGORITHMS  # noqa: E402 - one list, validated there
from gradientflow.stores import own_connection

__all__ = ["ALGORITHMS", "Algorithms", "AlgorithmWork", "StepFailed", "Topology",
           "algorithm_stats", "reset_algorithm_stats"]


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
        self._store = store
        self.rank = rank
        self.size = size
        self.timeout_s = timeout_s
        self._make_group = make_group
        self.label = label
        self._topo: Topology | None = None
        self._lock = threading.Lock()
        self._channels: list[Channel] = []
        if self.name == "reduction_server" and self.reducers < 1:
            raise ValueError(
                f"gradientflow: rank {rank}: algorithm=reduction_server needs reducers >= 1 "
                "(GRADIENTFLOW_REDUCERS or the reducers option), as many as the reducer "
                "processes started with python -m gradientflow.reducer --reducers R")

    def topology(self) -> Topology:
        """Which ranks share a host (read through the store once, by every rank)."""
        with self._lock:
            if self._topo is None:
                # on a connection of its own: a thread creating a transport group on the
                # shared one may be waiting there for a peer that waits for this exchange
                self._topo = discover(own_connection(self._store), self.rank, self.size,
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
                own.append(own_connection(self._store))
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
        return getattr(self.channel._base(self.device), name)


class _Works:
    """CUDA hierarchical: the stages' Works, waited in order (orders the caller's stream)."""

    def __init__(self, works: list[Any], tensors: list) -> None:
        self._works = works
        self._tensors = tensors

    def wait(self, timeout=None) -> bool:
        for w in self._works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


class Channel:
    """One transport stream of a group under its algorithm: an executor and the groups of
    each algorithm it used, created at the first message that needs them."""

    def __init__(self, algos: Algorithms, name: str,
                 transport_for: Callable[[torch.device], Any]) -> None:
        self.algos = algos
        self.name = name
        self._base = transport_for
        self._bound: dict[str, _Bound] = {}
        self._executor: Executor | None = None
        self._hier = None
        self._rs = None
        self._lock = threading.Lock()

    def transport_for(self, device: torch.device) -> _Bound:
        b = self._bound.get(device.type)
        if b is None:
            b = self._bound[device.type] = _Bound(self, device)
        return b

    def pick(self, tensor: torch.Tensor, opts: Any) -> str:
        """The algorithm for this message (a function of the call alone: same on every rank);
        ring.FALLBACK: ring, for a message the configured reduction_server cannot take."""
        from gradientflow.algorithms import reduction_server as rs

        a = self.algos
        name = a.name
        if name == "ring":
            return name
        nbytes = tensor.numel() * tensor.element_size()
        if name == "auto":
            reducers = a.reducers if rs.supports(tensor, opts) else 0
            name = _auto.choose(nbytes, a.size, a.topology(), reducers)
        if a.size <= 1:
            return "ring"
        if name == "reduction_server" and not rs.supports(tensor, opts):
            # CUDA tensors, or an op or dtype the reducers do not implement: ring carries it,
            # counted apart so stats() shows what reduction_server did not take
            return _ring.FALLBACK
        return name

    def _exec(self) -> Executor:
        if self._executor is None:
            self._executor = Executor(f"{self.algos.label}-{self.name}-algorithm")
        return self._executor

    def allreduce(self, device: torch.device, tensors, opts=None):
        t = tensors[0]
        name = self.pick(t, opts)
        a = self.algos
        if name in ("ring", _ring.FALLBACK):
            return _ring.allreduce(self._base(device), t, opts, a.rank, a.size,
                                   a.known_topology(), label=name)
        with self._lock:
            if name == "hierarchical":
                hier = self._hierarchical()
                if device.type == "cuda":
                    return _Works(hier.allreduce_issue(t, opts), tensors)
                return self._exec().submit(lambda: hier.allreduce_blocking(t, opts))
            server = self._reduction_server()
            return self._exec().submit(lambda: server.allreduce_blocking(t, opts))

    def _hierarchical(self):
        if self._hier is None:
            from gradientflow.algorithms.hierarchical import HierarchicalChannel

            a = self.algos
            self._hier = HierarchicalChannel(a.topology, a.rank, a.group_maker(),
                                             f"gradientflow/algo/{self.name}/")
        return self._hier

    def _reduction_server(self):
        if self._rs is None:
            from gradientflow.algorithms.reduction_server import ReductionServerChannel

            a = self.algos
            self._rs = ReductionServerChannel(a._store, a.rank, a.size, a.reducers,
                                              a.timeout_s, f"{a.label}.{self.name}", a.label)
        return self._rs

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.close()
        if self._hier is not None:
            self._hier.shutdown()
