"""Which ranks of a process group share a host, read once through the group's store.

Each rank publishes its host key (Config.host: by default torchrun's node, RANK - LOCAL_RANK,
with the machine's name) and reads everyone's; hosts are numbered by their lowest rank, ranks
inside a host by group rank. LOCAL_WORLD_SIZE, when torchrun set it, must match the count.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """Hosts of a group: `hosts[h]` its ranks (ascending), `host_of[r]` the host of rank r."""

    hosts: tuple[tuple[int, ...], ...]
    host_of: tuple[int, ...]

    @property
    def num_hosts(self) -> int:
        return len(self.hosts)

    def local_rank(self, rank: int) -> int:
        return self.hosts[self.host_of[rank]].index(rank)

    def leader(self, host: int) -> int:
        return self.hosts[host][0]

    @property
    def max_local(self) -> int:
        return max(len(h) for h in self.hosts)

    @classmethod
    def from_keys(cls, keys: list[str]) -> "Topology":
        order: dict[str, int] = {}
        host_of = []
        for key in keys:
            host_of.append(order.setdefault(key, len(order)))
        hosts = tuple(tuple(r for r, h in enumerate(host_of) if h == i) for i in range(len(order)))
        return cls(hosts, tuple(host_of))


def discover(store, rank: int, size: int, host: str, timeout_s: float,
             prefix: str = "gradientflow/topology/", local_world_size: int = 0) -> Topology:
    """Exchange host keys through `store`; every rank gets the same Topology."""
    key = host or socket.gethostname()
    store.set(f"{prefix}{rank}", key.encode())
    try:
        keys = [store.get(f"{prefix}{r}").decode() for r in range(size)]
    except Exception as exc:  # noqa: BLE001
        raise RuntimeError(
            f"gradientflow: rank {rank}: the hierarchy needs every rank's host, but not every "
            f"rank published it within {timeout_s:.0f} s ({exc}); every rank of the group must "
            "use the same algorithm setting") from exc
    topo = Topology.from_keys(keys)
    mine = len(topo.hosts[topo.host_of[rank]])
    if local_world_size and topo.num_hosts > 1 and mine > local_world_size:
        raise ValueError(
            f"gradientflow: rank {rank}: {mine} ranks of the group report host {key!r} but "
            f"LOCAL_WORLD_SIZE is {local_world_size}; set GRADIENTFLOW_HOST (or the host "
            "option) to tell hosts apart")
    return topo
