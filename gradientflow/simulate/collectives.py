"""Alpha-beta costs of the allreduce algorithms, and the bytes each GPU sends.

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

from gradientflow.simulate.cluster import Cluster, Method

GBIT = 1e9 / 8  # bytes/s per Gbit/s


def _bw(cl: Cluster, method: Method, gbps: float) -> float:
    """Bytes/s a bulk transfer reaches on a link of `gbps` under this transport."""
    del method  # the host path's cost is per byte of payload (step.message_cost), not per link
    return cl.link_efficiency * gbps * GBIT


def allreduce_parts(cl: Cluster, method: Method, nbytes: float) -> tuple[float, float]:
    """(latency seconds, transfer seconds) to allreduce `nbytes` per GPU on the cluster."""
    n, g, N = cl.gpus, cl.local, cl.nodes
    if n == 1 or nbytes <= 0:
        return 0.0, 0.0
    algo = method.algorithm
    if algo != "ring" and N == 1:
        algo = "ring"  # one node: both two-level algorithms are the node's ring
    a_in, a_out = cl.intra_latency_us * 1e-6, cl.inter_latency_us * 1e-6
    if method.transport == "host":
        a_in = a_out = cl.host_latency_us * 1e-6
    if algo == "ring":
        b = _bw(cl, method, min(cl.inter_gbps, cl.intra_gbps) if N > 1 else cl.intra_gbps)
        return 2 * (n - 1) * (a_out if N > 1 else a_in), 2 * (n - 1) * nbytes / n / b
    lat = 2 * (g - 1) * a_in
    xfer = 2 * (g - 1) * nbytes / g / _bw(cl, method, cl.intra_gbps)
    b_inter = _bw(cl, method, cl.inter_gbps)
    if algo == "hierarchical":
        return lat + 2 * (N - 1) * a_out, xfer + 2 * (N - 1) * nbytes / N / b_inter
    k = method.reducers or N
    return lat + 2 * a_out, xfer + nbytes / min(b_inter, k * b_inter / N)


def allreduce_time(cl: Cluster, method: Method, nbytes: float) -> float:
    """Seconds to allreduce `nbytes` per GPU with the method's algorithm on the cluster."""
    return sum(allreduce_parts(cl, method, nbytes))


def bytes_sent(cl: Cluster, method: Method, nbytes: float) -> float:
    """Bytes one GPU sends (intra-node and inter-node together) to allreduce `nbytes`."""
    n, g, N = cl.gpus, cl.local, cl.nodes
    if n == 1:
        return 0.0
    algo = method.algorithm if N > 1 else "ring"
    if algo == "ring":
        return 2 * (n - 1) / n * nbytes
    intra = 2 * (g - 1) / g * nbytes
    if algo == "hierarchical":
        return intra + 2 * (N - 1) / N * nbytes / g
    return intra + nbytes / g  # each GPU's share of its node's single copy to the reducers


def algorithm_bandwidth(cl: Cluster, method: Method, nbytes: float) -> float:
    """Allreduce algorithm bandwidth in Gbit/s: payload bytes over time (NCCL's algbw)."""
    t = allreduce_time(cl, method, nbytes)
    return nbytes / t / GBIT if t > 0 else float("inf")
