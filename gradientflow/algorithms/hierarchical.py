"""hierarchical: reduce inside each host, allreduce across hosts between one rank per host
(the host's lowest rank, its leader), broadcast inside each host.

Only the leaders' allreduce crosses hosts: 2(H-1)/H of the message per leader for H hosts,
where the ring over all n ranks sends 2(n-1)/n of it from every rank whose ring neighbour
sits on another host. The groups are torch.distributed process groups on the transport of
the message's device (gloo for CPU, NCCL for CUDA): one per host (its ranks) and one of the
leaders, created by every rank at the channel's first hierarchical message.

Pipelining: a message is cut into CHUNK_BYTES pieces; every piece's local reduce is issued at
once, and the leader starts a piece's cross-host allreduce as soon as its reduce is done, then
its broadcast, so the three stages overlap on different links.

Summation order: each element is first summed inside its host by the transport's reduce
(gloo: the host's ranks in its reduce order), then across hosts by the transport's ring over
the leaders in host order. A sum over hosts of per-host sums: equal to ring's up to float
rounding, and exactly equal whenever the partial sums are exact (integers, say).
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch
from torch._C._distributed_c10d import BroadcastOptions, ReduceOptions

from gradientflow import algorithm_registry as registry
from gradientflow.algorithms.base import record_bytes
from gradientflow.algorithms.topology import Topology

NAME = "hierarchical"
CHUNK_BYTES = 4 * 2**20  # pieces of a message in flight at once across the three stages


def traffic(topo: Topology, rank: int, nbytes: int) -> tuple[float, ...]:
    """(sent, received, inter-host sent, inter-host received) bytes of one message."""
    host = topo.host_of[rank]
    local = len(topo.hosts[host])
    leader = topo.leader(host) == rank
    sent = recv = 0.0
    cross = 0.0
    if local > 1:
        if leader:  # receives every other rank's part, sends the result back to each
            recv += (local - 1) * nbytes
            sent += (local - 1) * nbytes
        else:
            sent += nbytes
            recv += nbytes
    if leader and topo.num_hosts > 1:
        h = topo.num_hosts
        cross = 2.0 * (h - 1) / h * nbytes
    return (sent + cross, recv + cross, cross, cross)


class Hierarchy:
    """The per-host group and the leaders' group of one channel, for one device type."""

    def __init__(self, topo: Topology, rank: int,
                 make_group: Callable[[int, int, str], Any], prefix: str) -> None:
        self.topo = topo
        self.rank = rank
        host = topo.host_of[rank]
        self.host = host
        self.local_rank = topo.local_rank(rank)
        self.local_size = len(topo.hosts[host])
        self.leader = self.local_rank == 0
        self.local = (make_group(self.local_rank, self.local_size, f"{prefix}host{host}/")
                      if self.local_size > 1 else None)
        self.cross = (make_group(host, topo.num_hosts, f"{prefix}leaders/")
                      if self.leader and topo.num_hosts > 1 else None)

    def run(self, tensor: torch.Tensor, opts: Any) -> list[Any]:
        """Issue the three stages of every piece; returns the Works still to wait on."""
        flat = tensor.view(-1)
        per = max(1, CHUNK_BYTES // max(1, tensor.element_size()))
        pieces = list(flat.split(per)) if flat.numel() else [flat]
        op = opts.reduceOp
        tail: list[Any] = []
        reduces = []
        if self.local is not None:
            ropts = ReduceOptions()
            ropts.reduceOp = op
            ropts.rootRank = 0
            reduces = [self.local.reduce([p], ropts) for p in pieces]
        crosses = []
        if self.cross is not None:
            for i, p in enumerate(pieces):
                if reduces:
                    reduces[i].wait()
                crosses.append(self.cross.allreduce([p], _ar_opts(op)))
        elif self.leader:
            crosses = reduces  # one host: the reduce is the whole sum
        if self.local is not None:
            bopts = BroadcastOptions()
            bopts.rootRank = 0
            bopts.rootTensor = 0
            for i, p in enumerate(pieces):
                if self.leader:
                    crosses[i].wait()
                tail.append(self.local.broadcast([p], bopts))
            if not self.leader:
                tail.extend(reduces)
        else:
            tail.extend(crosses)
        return tail

    def shutdown(self) -> None:
        for g in (self.local, self.cross):
            if g is not None:
                try:
                    g.shutdown()
                except Exception:  # noqa: BLE001 - best effort at teardown
                    pass


def _ar_opts(op: Any):
    from torch._C._distributed_c10d import AllreduceOptions

    o = AllreduceOptions()
    o.reduceOp = op
    return o


class HierarchicalChannel:
    """hierarchical for one channel: its groups per device type, created on first use."""

    def __init__(self, topo_of: Callable[[], Topology], rank: int,
                 make_group: Callable[[str, int, int, str], Any], prefix: str) -> None:
        self._topo_of = topo_of
        self._rank = rank
        self._make_group = make_group
        self._prefix = prefix
        self._by_type: dict[str, Hierarchy] = {}
        self._lock = threading.Lock()

    def hierarchy(self, device: torch.device) -> Hierarchy:
        with self._lock:
            h = self._by_type.get(device.type)
            if h is None:
                h = self._by_type[device.type] = Hierarchy(
                    self._topo_of(), self._rank,
                    lambda r, n, p: self._make_group(device.type, r, n, p),
                    f"{self._prefix}{device.type}/")
            return h

    def allreduce_blocking(self, tensor: torch.Tensor, opts: Any) -> list:
        """CPU: run every stage and wait for it (on the channel's executor thread)."""
        h = self.hierarchy(tensor.device)
        nbytes = tensor.numel() * tensor.element_size()
        record_bytes(NAME, nbytes, *traffic(h.topo, self._rank, nbytes))
        for w in h.run(tensor, opts):
            w.wait()
        return [tensor]

    def allreduce_issue(self, tensor: torch.Tensor, opts: Any) -> list[Any]:
        """CUDA: issue every stage on the caller's stream; returns the Works to wait on."""
        h = self.hierarchy(tensor.device)
        nbytes = tensor.numel() * tensor.element_size()
        record_bytes(NAME, nbytes, *traffic(h.topo, self._rank, nbytes))
        return h.run(tensor, opts)

    def shutdown(self) -> None:
        for h in self._by_type.values():
            h.shutdown()


class _Works:
    """CUDA: the stages' Works, waited in order (orders the caller's stream)."""

    def __init__(self, works: list[Any], tensors: list) -> None:
        self._works = works
        self._tensors = tensors

    def wait(self, timeout=None) -> bool:
        for w in self._works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


class HierarchicalHandler:
    """A channel's hierarchical: its groups, created at the first message that needs them."""

    def __init__(self, channel: Any) -> None:
        a = channel.algos
        self._channel = channel
        self._hier = HierarchicalChannel(a.topology, a.rank, a.group_maker(),
                                         f"gradientflow/algo/{channel.name}/")

    def allreduce(self, device: torch.device, tensors: list, opts: Any) -> Any:
        t = tensors[0]
        with self._channel.lock:
            if device.type == "cuda":
                return _Works(self._hier.allreduce_issue(t, opts), tensors)
            return self._channel.executor().submit(lambda: self._hier.allreduce_blocking(t, opts))

    def shutdown(self) -> None:
        self._hier.shutdown()


ALGORITHM = registry.attach(NAME, build=HierarchicalHandler)
