"""What the cost model is told about the hardware and about the communication scheme.

Two frozen dataclasses, validated once: `Cluster` (GPUs, links, latencies, per-GPU
throughput) and `Method` (algorithm, fusion, FP16, CSC, overlap, priority), plus the named
presets the CLI's --method accepts.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from gradientflow import algorithm_registry as registry

ALGORITHMS = registry.simulated()  # the algorithms whose cluster model is registered
TRANSPORTS = ("gpu", "host")
MB = 10**6


@dataclass(frozen=True)
class Cluster:
    """A homogeneous GPU cluster: `gpus` GPUs, `gpus_per_node` of them per node.

    Bandwidths are nominal line rates in Gbit/s per direction; `link_efficiency` is the fraction
    of a line rate a bulk transfer reaches (calibrated on our emulated switch). Latencies are per
    message step (one hop of a ring, one send to a reducer). `throughput` is one GPU's training
    rate in samples/s at the model's per-GPU batch; None takes the model table's default.
    """

    gpus: int = 512
    gpus_per_node: int = 8
    inter_gbps: float = 56.0
    intra_gbps: float = 100.0
    inter_latency_us: float = 6.0
    intra_latency_us: float = 2.0
    link_efficiency: float = 0.915  # calibrate.FITTED: our emulated switch, gloo over TCP
    throughput: float | None = None
    # Host-staged transports (transport="host": gradients copied to host memory, reduced by the
    # CPU, sent over TCP): CPU ms per MB of allreduce payload (calibrated on our gloo runs). On
    # GPU nodes it lengthens each collective (the CPU is in the data path); with cpu_ranks (the
    # ranks compute on the CPU, as in our emulated runs) it delays compute instead.
    host_ms_per_mb: float = 1.345
    # ... and its latency per message step (gloo's TCP round trip, the Python hook), also
    # calibrated; it replaces inter/intra_latency_us for host-staged transports.
    host_latency_us: float = 354.0
    cpu_ranks: bool = False
    # Step-time jitter of one GPU (coefficient of variation): a synchronous step waits for the
    # slowest of n, about mean x (1 + cv sqrt(2 ln n)) for Gaussian jitter. 0 = no stragglers.
    straggler_cv: float = 0.0
    # GPU memory bandwidth for the compression kernels (CSC norms, pack, residual; FP16 casts).
    gpu_mem_gbps: float = 6400.0

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Cluster: {name}={v!r} must be an integer >= 1")
        for name in ("inter_gbps", "intra_gbps", "gpu_mem_gbps"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ValueError(f"Cluster: {name}={v!r} must be a positive number (Gbit/s)")
        for name in ("inter_latency_us", "intra_latency_us", "host_ms_per_mb", "host_latency_us",
                     "straggler_cv"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"Cluster: {name}={v!r} must be a number >= 0")
        if not 0 < self.link_efficiency <= 1:
            raise ValueError(f"Cluster: link_efficiency={self.link_efficiency!r} must be in (0, 1]")
        if self.throughput is not None and not self.throughput > 0:
            raise ValueError(f"Cluster: throughput={self.throughput!r} must be > 0 samples/s")

    @property
    def local(self) -> int:
        """GPUs that share a node (fewer than gpus_per_node when the job is smaller)."""
        return min(self.gpus, self.gpus_per_node)

    @property
    def nodes(self) -> int:
        """Nodes the job spans."""
        return math.ceil(self.gpus / self.gpus_per_node)

    def with_gpus(self, gpus: int) -> Cluster:
        """The same cluster running a job of `gpus` GPUs."""
        return dataclasses.replace(self, gpus=gpus)


@dataclass(frozen=True)
class Method:
    """How gradients are exchanged: algorithm, fusion, wire format, CSC, overlap, priority.

    fusion_threshold: bytes of FP32 gradient per fused message (lazy allreduce); 0 sends every
    tensor alone. solo_threshold: a tensor at least this big goes alone (0: never). cycle_ms: a
    partial message goes out when no gradient arrives for this long. csc_density: fraction of
    chunks sent (None: dense). priority: among messages ready at once, send first the one the
    next forward needs first; forward_gating: the next forward starts each layer as soon as its
    gradients are reduced (else it waits for every message).
    """

    name: str = "custom"
    algorithm: str = "ring"
    transport: str = "gpu"
    fusion_threshold: int = 128 * 2**20
    solo_threshold: int = 4 * MB
    cycle_ms: float = 3.0
    fp16: bool = True
    csc_density: float | None = 0.01
    chunk_size: int = 1024
    overlap: bool = True
    priority: bool = True
    forward_gating: bool = False
    reducers: int = 0  # reduction_server: 0 = as many reducers as nodes, each at inter_gbps

    def __post_init__(self) -> None:
        if self.algorithm not in registry.simulated():
            raise ValueError(f"Method: algorithm={self.algorithm!r}; use one of "
                             f"{registry.simulated()}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"Method: transport={self.transport!r}; use one of {TRANSPORTS}")
        if self.fusion_threshold < 0 or self.solo_threshold < 0 or self.cycle_ms < 0:
            raise ValueError("Method: fusion_threshold, solo_threshold and cycle_ms must be >= 0")
        d = self.csc_density
        if d is not None and not 0 < d <= 1:
            raise ValueError(f"Method: csc_density={d!r} must be in (0, 1] or None (dense)")
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"Method: chunk_size={self.chunk_size!r} must be an integer >= 1")
        if self.reducers < 0:
            raise ValueError(f"Method: reducers={self.reducers!r} must be >= 0")

    @property
    def wire_bytes(self) -> int:
        """Bytes per gradient element on the wire."""
        return 2 if self.fp16 else 4


PRESETS: dict[str, Method] = {
    # This project's DistributedOptimizer with its defaults (or DDP with our CSC hook): 25 MiB
    # partitions (DDP's bucket size), each one message, FP16 wire, CSC 1% of 1024-element
    # chunks (CompressionConfig), overlap with backward, TicTac priority; a ring underneath.
    "gradientflow": Method(name="gradientflow", fusion_threshold=25 * 2**20, solo_threshold=0,
                           cycle_ms=math.inf),
    # Per-tensor allreduce calls on a gradientflow process group with Config's defaults: lazy
    # allreduce at 128 MiB, tensors of 4 MB or more alone, a partial batch out after a 3 ms lull.
    "gradientflow-engine": Method(name="gradientflow-engine"),
    # The paper's GradientFlow as we read it: ring allreduce, lazy allreduce that launches when
    # the pool holds the threshold or backward ends (no solo cut, no cycle; threshold value
    # unverified, ours), FP16 wire, CSC at our 1% of 1024-element chunks (unverified), overlap.
    "gradientflow-paper": Method(name="gradientflow-paper", solo_threshold=0, cycle_ms=math.inf,
                                 priority=False),
    # A plain open-source ring allreduce: one FP32 allreduce per gradient tensor, overlapped
    # with backward (DDP/Horovod without fusion), no compression, no priority.
    "ring": Method(name="ring", fusion_threshold=0, solo_threshold=0, fp16=False,
                   csc_density=None, priority=False),
    # Horovod 0.1x: Tensor Fusion (64 MB buffer, 5 ms cycle), FP32, flat NCCL ring.
    "horovod": Method(name="horovod", fusion_threshold=64 * 2**20, solo_threshold=0,
                      cycle_ms=5.0, fp16=False, csc_density=None, priority=False),
    # Horovod's hierarchical allreduce: reduce-scatter in the node, allreduce across nodes,
    # allgather in the node; Tensor Fusion, FP32.
    "hierarchical": Method(name="hierarchical", algorithm="hierarchical",
                           fusion_threshold=64 * 2**20, solo_threshold=0, cycle_ms=5.0,
                           fp16=False, csc_density=None, priority=False),
    # Vertex AI's Reduction Server: every node sends its (node-reduced) gradient once to the
    # reducers and receives the sum once; FP32 dense, fused.
    "reduction_server": Method(name="reduction_server", algorithm="reduction_server",
                               fusion_threshold=64 * 2**20, solo_threshold=0, cycle_ms=5.0,
                               fp16=False, csc_density=None, priority=False),
}


def preset(name: str, **overrides) -> Method:
    """A named method (gradientflow, ring, horovod, hierarchical, reduction_server), overridden."""
    if name not in PRESETS:
        raise ValueError(f"unknown method {name!r}; use one of {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)
