"""ring: the transport's own allreduce (gloo's ring on CPU, NCCL's on CUDA), unchanged.

Summation order: the transport's. gloo's ring reduce-scatter adds each chunk as it travels
around the ranks in rank order, so each element's sum starts at a different rank; NCCL's ring
likewise. Every other algorithm is checked against this one (exactly on integer-valued data,
up to float rounding otherwise).
"""
from __future__ import annotations

from typing import Any

import torch

from gradientflow import algorithm_registry as registry
from gradientflow.algorithms.base import record_bytes
from gradientflow.algorithms.topology import Topology

NAME = "ring"
# The stats key of messages ring carries because reduction_server cannot take them (CUDA
# tensors; an op or dtype the reducers do not implement): see docs/ALGORITHMS.md.
FALLBACK = "ring_fallback"


def traffic(topo: Topology | None, rank: int, size: int, nbytes: int) -> tuple[float, ...]:
    """(sent, received, inter-host sent, inter-host received) bytes of one ring allreduce:
    2(n-1)/n of the message each way, to rank+1 and from rank-1."""
    if size <= 1:
        return (0.0, 0.0, 0.0, 0.0)
    each = 2.0 * (size - 1) / size * nbytes
    if topo is None:
        return (each, each, 0.0, 0.0)
    out = each if topo.host_of[rank] != topo.host_of[(rank + 1) % size] else 0.0
    into = each if topo.host_of[rank] != topo.host_of[(rank - 1) % size] else 0.0
    return (each, each, out, into)


def allreduce(transport: Any, tensor: torch.Tensor, opts: Any, rank: int, size: int,
              topo: Topology | None, label: str = NAME) -> Any:
    """Hand the message to the transport as is; count its bytes under `label`."""
    nbytes = tensor.numel() * tensor.element_size()
    record_bytes(label, nbytes, *traffic(topo, rank, size, nbytes))
    return transport.allreduce([tensor], opts)


class RingHandler:
    """A channel's ring: its transport's allreduce, the bytes counted under `label`."""

    def __init__(self, channel: Any, label: str = NAME) -> None:
        self._channel = channel
        self._label = label

    def allreduce(self, device: torch.device, tensors: list, opts: Any) -> Any:
        a = self._channel.algos
        return allreduce(self._channel.transport(device), tensors[0], opts, a.rank, a.size,
                         a.known_topology(), label=self._label)


ALGORITHM = registry.attach(NAME, build=RingHandler)
