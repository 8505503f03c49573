"""auto: pick ring, hierarchical or reduction_server per message from a modelled cost.

The alpha-beta model, per message of D bytes, n ranks on H hosts (at most L ranks on one
host), R reducers (0: none configured):

    ring           2(n-1) a + 2(n-1)/n D / B      B = B_x when H > 1 (the ring crosses hosts;
                                                  its slowest link sets the pace), else B_l
    hierarchical   2 a + 2(L-1) D / B_l           reduce to and broadcast from the leader,
                   + 2(H-1) a + 2(H-1)/H D / B_x  plus the leaders' ring across hosts
    reduction_srv  4 a + max(D, n D / R) / B_x    each worker's link carries D each way (full
                   + ROUND / B_x                  duplex, pipelined by pieces); each reducer's
                                                  link n D / R; one round of pieces (1 MiB,
                                                  one piece per reducer) to fill

plus S = 450 us for hierarchical and reduction_server (three waits on the channel's executor
thread: the hand-off, the stages, the agreement). a = 100 us per transport step,
B_x = 10 Gbit/s between hosts, B_l = 40 Gbit/s inside a host (shared memory or loopback on a
real host). The smallest modelled time wins; ties go to ring,
then hierarchical. hierarchical is a candidate only with H > 1 and L > 1 (otherwise it is the
ring with extra steps), reduction_server only when reducers are configured and the message is
on CPU with a reduce op the reducers implement. The choice is a pure function of the message
size and the topology, so every rank makes the same one.

Each algorithm's formula is its `cost` in gradientflow/algorithm_registry.py; this module holds
the constants and weighs the candidates the table offers for the message.

What the rule gives at n = 4 is tabulated in docs/ALGORITHMS.md (tests/algorithms checks
some of its rows).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from gradientflow import algorithm_registry as registry
from gradientflow.algorithms.topology import Topology


@dataclass(frozen=True)
class CostModel:
    """The model's constants (seconds, bytes per second)."""

    alpha_s: float = 100e-6
    inter_host_Bps: float = 10e9 / 8
    intra_host_Bps: float = 40e9 / 8
    rs_chunk_bytes: int = 2**20  # reduction_server.ROUND_BYTES: one round of pieces
    # What a multi-group algorithm pays on top: its hand-off to the channel's executor thread
    # and back, and one wait per stage on a thread that must be woken (3 stages).
    stages_s: float = 3 * 150e-6


DEFAULT_MODEL = CostModel()


def costs(nbytes: int, size: int, topo: Topology | None, reducers: int,
          model: CostModel = DEFAULT_MODEL,
          carries: Callable[[registry.Algorithm], bool] | None = None) -> dict[str, float]:
    """Modelled seconds of each candidate algorithm for one message of `nbytes` (each
    algorithm's own `cost`); `carries`: whether one can take this message (default: all)."""
    if size <= 1:
        return {registry.BASELINE: 0.0}
    hosts = topo.num_hosts if topo is not None else 1
    local = topo.max_local if topo is not None else 1
    return {a.name: a.cost(nbytes, size, hosts, local, reducers, model)
            for a in registry.entries()
            if a.cost is not None and a.offered(hosts, local, reducers)
            and (carries is None or carries(a))}


def choose(nbytes: int, size: int, topo: Topology | None, reducers: int,
           model: CostModel = DEFAULT_MODEL,
           carries: Callable[[registry.Algorithm], bool] | None = None) -> str:
    """The algorithm `auto` uses for a message of `nbytes` (same on every rank): the cheapest,
    ties to the earlier in the table."""
    c = costs(nbytes, size, topo, reducers, model, carries)
    order = registry.names()
    return min(c, key=lambda k: (c[k], order.index(k)))


def _for_message(algos: Any, tensor: Any, opts: Any) -> str:
    """The choice for one message of a group (its size, topology and reducers)."""
    nbytes = tensor.numel() * tensor.element_size()
    return choose(nbytes, algos.size, algos.topology(), algos.reducers,
                  carries=lambda a: a.carries(tensor, opts))


ALGORITHM = registry.attach("auto", choose=_for_message)
