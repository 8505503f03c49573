"""Alpha-beta costs of the allreduce algorithms, and the bytes each GPU sends: each
algorithm's formula is its `simulate` in gradientflow/algorithm_registry.py; this module
describes the cluster to it.

For S bytes per GPU on n GPUs (g per node, N nodes), per-step latency a and per-direction
bandwidth B (line rate x link efficiency):

- ring (flat, node-contiguous order): 2(n-1) steps of S/n bytes, each as slow as the slowest
  edge: T = 2(n-1) (a + S / (n B_min)). Each GPU sends 2(n-1)/n S.
- hierarchical (Horovod): reduce-scatter in the node, ring allreduce of the node's S across the
  N nodes (the g GPUs of a node share its NIC, each carrying S/g), allgather in the node:
  T = 2(g-1)(a_intra + S/(g B_intra)) + 2(N-1)(a_inter + S/(N B_inter)).
- reduction_server (Vertex AI): the same intra-node phases, then every node sends its reduced S
  once to the reducers and receives the sum once (full duplex, pipelined):
  T = 2(g-1)(...) + 2 a_inter + S / min(B_inter, k B_r / N), k reducers of bandwidth B_r.
"""
from __future__ import annotations

from gradientflow import algorithm_registry as registry
from gradientflow.simulate.cluster import Cluster, Method

GBIT = 1e9 / 8  # bytes/s per Gbit/s


def _bw(cl: Cluster, method: Method, gbps: float) -> float:
    """Bytes/s a bulk transfer reaches on a link of `gbps` under this transport."""
    del method  # the host path's cost is per byte of payload (step.message_cost), not per link
    return cl.link_efficiency * gbps * GBIT


def links(cl: Cluster, method: Method) -> registry.Links:
    """The cluster as the numbers an algorithm's formula reads (algorithm_registry.Links)."""
    a_in, a_out = cl.intra_latency_us * 1e-6, cl.inter_latency_us * 1e-6
    if method.transport == "host":
        a_in = a_out = cl.host_latency_us * 1e-6
    return registry.Links(cl.gpus, cl.local, cl.nodes, a_in, a_out,
                          _bw(cl, method, cl.intra_gbps), _bw(cl, method, cl.inter_gbps),
                          method.reducers)


def _algorithm(cl: Cluster, method: Method) -> registry.Algorithm:
    # One node: every two-level algorithm is the node's ring.
    return registry.lookup(method.algorithm if cl.nodes > 1 else registry.BASELINE)


def allreduce_parts(cl: Cluster, method: Method, nbytes: float) -> tuple[float, float]:
    """(latency seconds, transfer seconds) to allreduce `nbytes` per GPU on the cluster."""
    if cl.gpus == 1 or nbytes <= 0:
        return 0.0, 0.0
    return _algorithm(cl, method).simulate(links(cl, method), nbytes)


def allreduce_time(cl: Cluster, method: Method, nbytes: float) -> float:
    """Seconds to allreduce `nbytes` per GPU with the method's algorithm on the cluster."""
    return sum(allreduce_parts(cl, method, nbytes))


def bytes_sent(cl: Cluster, method: Method, nbytes: float) -> float:
    """Bytes one GPU sends (intra-node and inter-node together) to allreduce `nbytes`."""
    if cl.gpus == 1:
        return 0.0
    return _algorithm(cl, method).sim_bytes(links(cl, method), nbytes)


def algorithm_bandwidth(cl: Cluster, method: Method, nbytes: float) -> float:
    """Allreduce algorithm bandwidth in Gbit/s: payload bytes over time (NCCL's algbw)."""
    t = allreduce_time(cl, method, nbytes)
    return nbytes / t / GBIT if t > 0 else float("inf")
