"""The one table of collective algorithms: per algorithm its name, where it applies, its cost
under each model, and (attached by its module) how a channel runs it.

Config validation (`algorithm=`), the Channel (which algorithm carries a message and how),
`auto` (the modelled cost of each candidate), autotune (which choices a topology offers) and
the simulator (the cluster model's time and bytes) read this table; none of them names an
algorithm. Adding one is one entry here (its name and formulas: plain arithmetic) plus its
module under gradientflow/algorithms/, which attaches what runs it (`attach`: its handler,
which messages it carries) and is imported by that package's `__init__.py`.

Leaf module (the bottom layer, tests/test_layers.py): config and the simulator read it, so it
imports nothing of gradientflow.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["BASELINE", "Algorithm", "Links", "register", "attach", "lookup", "names",
           "entries", "choice_order", "offered", "simulated"]

# The transport's own allreduce: what every other algorithm is checked against, what a group
# of one rank uses, and what carries a message another algorithm cannot take.
BASELINE = "ring"


@dataclass(frozen=True)
class Links:
    """The simulator's cluster, as numbers an algorithm's formula reads: `gpus` GPUs,
    `per_node` on each of `nodes` nodes, per-step latencies (s) and per-direction bandwidths
    (bytes/s) inside a node and between nodes, and `reducers` (0: as many as nodes)."""

    gpus: int
    per_node: int
    nodes: int
    a_intra: float
    a_inter: float
    b_intra: float
    b_inter: float
    reducers: int = 0

    def node_phases(self, nbytes: float) -> tuple[float, float]:
        """(latency s, transfer s) of a two-level algorithm's phases inside the node: a
        reduce-scatter and an allgather over its `per_node` GPUs."""
        g = self.per_node
        return 2 * (g - 1) * self.a_intra, 2 * (g - 1) * nbytes / g / self.b_intra


def _anywhere(num_hosts: int, max_local: int, reducers: int) -> bool:
    return True


def _any_message(tensor: Any, opts: Any) -> bool:
    return True


def _no_check(config: Any, rank: int) -> None:
    return None


@dataclass(frozen=True)
class Algorithm:
    """One collective algorithm for the allreduce of a flat message."""

    name: str
    summary: str
    # (hosts, most ranks on one host, reducers) -> whether it can differ from the baseline
    # there: autotune offers only those, auto weighs only those.
    offered: Callable[[int, int, int], bool] = _anywhere
    # (nbytes, size, hosts, max_local, reducers, model) -> seconds under auto's model of this
    # implementation (model: algorithms/auto.py's CostModel); None: auto never picks it.
    cost: Callable[..., float] | None = None
    # (links, nbytes) -> (latency s, transfer s), and the bytes one GPU sends, under the
    # simulator's cluster model (simulate/collectives.py); None: not simulated.
    simulate: Callable[[Links, float], tuple[float, float]] | None = None
    sim_bytes: Callable[[Links, float], float] | None = None
    # (group config, rank) -> raise ValueError naming the fix for a config it cannot serve.
    check: Callable[[Any, int], None] = _no_check
    # Whether it hands each message to another algorithm (auto) instead of running one.
    chooser: bool = False
    # --- attached by its module (gradientflow/algorithms/), what runs it ---------------------
    # channel -> its handler, with `allreduce(device, tensors, opts) -> Work` (and optionally
    # `shutdown()`).
    build: Callable[[Any], Any] | None = None
    # (tensor, opts) -> whether it can carry this message (else the baseline does, counted as
    # ring_fallback).
    carries: Callable[[Any, Any], bool] = _any_message
    # A chooser's rule: (Algorithms, tensor, opts) -> the name of the algorithm for a message.
    choose: Callable[[Any, Any, Any], str] | None = None


_TABLE: dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
    """Add `algorithm` to the table (its entry below, or a caller's own)."""
    known = _TABLE.get(algorithm.name)
    if known is not None and known != algorithm:
        raise ValueError(f"algorithm_registry.register: {algorithm.name!r} is already "
                         "registered")
    _TABLE[algorithm.name] = algorithm
    return algorithm


def attach(name: str, **runtime: Any) -> Algorithm:
    """Give the entry `name` what runs it (build, carries, choose): its module does this."""
    entry = dataclasses.replace(lookup(name), **runtime)
    _TABLE[name] = entry
    return entry


def entries() -> tuple[Algorithm, ...]:
    """Every registered algorithm, in the order ties and choice lists follow."""
    return tuple(_TABLE.values())


def names() -> tuple[str, ...]:
    """The names a config's `algorithm` may take."""
    return tuple(_TABLE)


def lookup(name: str) -> Algorithm:
    """The algorithm called `name`; ValueError listing the known ones otherwise."""
    found = _TABLE.get(name)
    if found is None:
        raise ValueError(f"collective algorithm {name!r} is not registered; known: "
                         f"{', '.join(names())}")
    return found


def choice_order() -> tuple[str, ...]:
    """Every algorithm as a list of choices: the baseline, then the choosers, then the rest."""
    choosers = [a.name for a in entries() if a.chooser]
    plain = [a.name for a in entries() if not a.chooser]
    return tuple(plain[:1] + choosers + plain[1:])


def offered(num_hosts: int, max_local: int, reducers: int) -> tuple[str, ...]:
    """The algorithms that can differ on this topology, in `choice_order`; the choosers only
    where there is something to choose (one entry: no choice)."""
    plain = [a.name for a in entries()
             if not a.chooser and a.offered(num_hosts, max_local, reducers)]
    if len(plain) < 2:
        return tuple(plain)
    return tuple(n for n in choice_order() if n in plain or lookup(n).chooser)


def simulated() -> tuple[str, ...]:
    """The algorithms the simulator can model."""
    return tuple(a.name for a in entries() if a.simulate is not None)


# --- the built-in algorithms (their modules: gradientflow/algorithms/<name>.py) ---------------
# auto's model, per message of D bytes on n ranks, H hosts, at most L ranks on one, R reducers:
# a per transport step, B_x between hosts, B_l inside one, S the hand-off to a channel's
# executor and its stage waits (algorithms/auto.py has the constants and the reasons).

def _ring_cost(nbytes, size, hosts, max_local, reducers, model) -> float:
    """2(n-1) a + 2(n-1)/n D / B, B the slowest link the ring crosses."""
    bw = model.inter_host_Bps if hosts > 1 else model.intra_host_Bps
    return 2 * (size - 1) * model.alpha_s + 2 * (size - 1) / size * nbytes / bw


def _ring_sim(links: Links, nbytes: float) -> tuple[float, float]:
    """2(n-1) steps of S/n bytes, each as slow as the slowest edge."""
    n, nodes = links.gpus, links.nodes
    b = min(links.b_inter, links.b_intra) if nodes > 1 else links.b_intra
    a = links.a_inter if nodes > 1 else links.a_intra
    return 2 * (n - 1) * a, 2 * (n - 1) * nbytes / n / b


def _ring_bytes(links: Links, nbytes: float) -> float:
    return 2 * (links.gpus - 1) / links.gpus * nbytes


def _hier_offered(num_hosts: int, max_local: int, reducers: int) -> bool:
    """Only across hosts with several ranks on one: otherwise the ring with extra steps."""
    return num_hosts > 1 and max_local > 1


def _hier_cost(nbytes, size, hosts, max_local, reducers, model) -> float:
    """S + 2a + 2(L-1) D / B_l (to and from the leader) + the leaders' ring across hosts."""
    a, bx, bl = model.alpha_s, model.inter_host_Bps, model.intra_host_Bps
    return (model.stages_s + 2 * a + 2 * (max_local - 1) * nbytes / bl
            + 2 * (hosts - 1) * a + 2 * (hosts - 1) / hosts * nbytes / bx)


def _hier_sim(links: Links, nbytes: float) -> tuple[float, float]:
    """Horovod's: the node's phases, then the node's S in a ring across the nodes."""
    lat, xfer = links.node_phases(nbytes)
    nodes = links.nodes
    return (lat + 2 * (nodes - 1) * links.a_inter,
            xfer + 2 * (nodes - 1) * nbytes / nodes / links.b_inter)


def _hier_bytes(links: Links, nbytes: float) -> float:
    g, nodes = links.per_node, links.nodes
    return 2 * (g - 1) / g * nbytes + 2 * (nodes - 1) / nodes * nbytes / g


def _rs_offered(num_hosts: int, max_local: int, reducers: int) -> bool:
    """Only with reducer processes serving the job."""
    return reducers >= 1


def _rs_check(config: Any, rank: int) -> None:
    """Refuse a group with no reducers to send to."""
    if config.reducers < 1:
        raise ValueError(
            f"gradientflow: rank {rank}: algorithm=reduction_server needs reducers >= 1 "
            "(GRADIENTFLOW_REDUCERS or the reducers option), as many as the reducer "
            "processes started with python -m gradientflow.reducer --reducers R")


def _rs_cost(nbytes, size, hosts, max_local, reducers, model) -> float:
    """S + 4a + max(D, n D / R) / B_x (each worker's link D each way, each reducer's n D / R)
    + one round of pieces to fill the pipeline."""
    bx = model.inter_host_Bps
    return (model.stages_s + 4 * model.alpha_s + max(nbytes, size * nbytes / reducers) / bx
            + min(nbytes, model.rs_chunk_bytes) / bx)


def _rs_sim(links: Links, nbytes: float) -> tuple[float, float]:
    """Vertex AI's: the node's phases, then the node's S to the reducers once and the sum back
    once (full duplex, pipelined)."""
    lat, xfer = links.node_phases(nbytes)
    k = links.reducers or links.nodes
    b = links.b_inter
    return lat + 2 * links.a_inter, xfer + nbytes / min(b, k * b / links.nodes)


def _rs_bytes(links: Links, nbytes: float) -> float:
    g = links.per_node
    return 2 * (g - 1) / g * nbytes + nbytes / g


register(Algorithm("ring", "the transport's own allreduce (gloo's ring on CPU, NCCL's on CUDA)",
                   cost=_ring_cost, simulate=_ring_sim, sim_bytes=_ring_bytes))
register(Algorithm("hierarchical", "reduce in each host, allreduce across the hosts' leaders, "
                   "broadcast in each host", offered=_hier_offered, cost=_hier_cost,
                   simulate=_hier_sim, sim_bytes=_hier_bytes))
register(Algorithm("reduction_server", "shards summed by reducer processes: each byte crosses "
                   "a worker's link once each way", offered=_rs_offered, cost=_rs_cost,
                   simulate=_rs_sim, sim_bytes=_rs_bytes, check=_rs_check))
register(Algorithm("auto", "per message, the algorithm of least modelled time", chooser=True))
