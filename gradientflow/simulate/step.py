"""Simulate one steady-state training step: compute, fusion, collectives, overlap, priority.

The step of one GPU is forward F then backward B (F + B = batch / throughput, split by the
profile's forward fraction). Each layer's gradient is ready at F + ready x B. Gradients are cut
into messages as lazy allreduce does (a tensor at least solo_threshold goes alone; the others
fill a message up to fusion_threshold, and a partial message goes out when no gradient arrived
for cycle_ms). Messages share one channel: one collective at a time, FIFO, or, with priority,
the one the next forward needs first among those ready. Compression kernels and host-side
copies run on the device that computes, so they stretch backward instead of overlapping.

The next step's forward starts when backward is done and every message has completed; with
forward_gating each layer of that forward waits only for its own message.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from gradientflow.simulate.cluster import MB, Cluster, Method
from gradientflow.simulate.collectives import allreduce_parts, bytes_sent
from gradientflow.simulate.models import Model, load

CSC_PASSES = 5  # FP32 passes of the CSC kernels: chunk norms, residual add (r+w), pack, unpack
FP16_PASSES = 3  # FP32 read + FP16 write before the collective, FP16 read + FP32 write after


@dataclass(frozen=True)
class Message:
    """One fused collective: what it carries and when it can start."""

    numel: int
    numel_dense: int  # elements CSC sends whole (1-D tensors, tensors under one chunk)
    ready: float  # share of backward
    fwd_index: int  # the earliest forward layer it holds
    layers: tuple[str, ...]  # the layers with a tensor in it


@dataclass(frozen=True)
class Result:
    """What one simulated configuration predicts (times in seconds, bytes per GPU per step)."""

    model: str
    method: str
    gpus: int
    gpus_per_node: int
    batch: int
    step_s: float
    compute_s: float
    overhead_s: float  # compression kernels and host-side copies (not overlapped)
    comm_s: float  # sum of all collectives' durations
    exposed_comm_s: float  # step minus compute (slowest GPU's) and overhead: what nothing hid
    speedup: float  # over one GPU running the same per-GPU batch without communication
    scaling_efficiency: float
    throughput: float  # samples/s of the whole job
    epoch_time_s: float
    train_time_s: float  # for the model's epochs
    wire_bytes: float  # bytes each GPU sends per step
    messages: int

    def to_dict(self) -> dict:
        """The result as a JSON-ready dict."""
        return asdict(self)


def _tensors(model: Model) -> list[tuple[int, int, float, int, str]]:
    """(numel, numel_1d, ready, fwd_index, layer) per tensor, backward order (1-D split evenly)."""
    out = []
    for layer in model.layers:
        big = layer.numel - layer.numel_1d
        if big:
            out.append((big, 0, layer.ready, layer.fwd_index, layer.name))
        k = layer.tensors - (1 if big else 0)
        for i in range(k):
            part = layer.numel_1d // k + (1 if i < layer.numel_1d % k else 0)
            out.append((part, part, layer.ready, layer.fwd_index, layer.name))
    return out


def plan(model: Model, method: Method, backward_s: float) -> list[Message]:
    """Cut the gradients into messages as lazy allreduce does (see the module docstring)."""
    chunk = method.chunk_size
    msgs: list[Message] = []
    cur: list[tuple[int, int, float, int, str]] = []

    def close():
        if cur:
            msgs.append(Message(sum(t[0] for t in cur),
                                sum(t[1] if t[0] >= chunk else t[0] for t in cur),
                                cur[-1][2], min(t[3] for t in cur),
                                tuple(dict.fromkeys(t[4] for t in cur))))
            cur.clear()

    for t in _tensors(model):
        nbytes = 4 * t[0]
        if method.fusion_threshold == 0 or (method.solo_threshold
                                            and nbytes >= method.solo_threshold):
            close()
            cur.append(t)
            close()
            continue
        if cur and (t[2] - cur[-1][2]) * backward_s * 1e3 > method.cycle_ms:
            close()  # quiet for a cycle: the partial message goes out
        cur.append(t)
        if 4 * sum(x[0] for x in cur) >= method.fusion_threshold:
            close()
    close()
    return msgs


def message_cost(cl: Cluster, method: Method, m: Message) -> tuple[float, float, float]:
    """(collective seconds, device seconds of kernels and host copies, bytes sent) of a message."""
    wire = method.wire_bytes
    dense = m.numel * wire
    payloads = [dense]
    kernel_bytes = FP16_PASSES * 4 * m.numel if method.fp16 else 0.0
    if method.csc_density is not None:
        sparse = m.numel - m.numel_dense
        nchunks = math.ceil(sparse / method.chunk_size)
        k = math.ceil(method.csc_density * nchunks)
        sel = min(k * method.chunk_size, sparse)
        csc = [4 * nchunks, (sel + m.numel_dense) * wire]
        if sum(csc) < dense:  # a message CSC cannot shrink is sent dense
            payloads = csc
            kernel_bytes = CSC_PASSES * 4 * m.numel
    sent = sum(bytes_sent(cl, method, p) for p in payloads)
    dev = kernel_bytes / (cl.gpu_mem_gbps * 1e9 / 8)
    host = method.transport == "host" and cl.gpus > 1
    t = 0.0
    for p in payloads:
        lat, xfer = allreduce_parts(cl, method, p)
        cpu = cl.host_ms_per_mb * 1e-3 * p / MB if host else 0.0
        if cl.cpu_ranks:  # the CPU that reduces and copies is the one that computes
            t, dev = t + lat + xfer, dev + cpu
        else:  # the CPU is a stage of the pipeline: the slower of it and the wire sets the pace
            t += lat + max(xfer, cpu)
    return t, dev, sent


def simulate(model: Model | str, cluster: Cluster, method: Method,
             compute_s: float | None = None) -> Result:
    """Predict one step of `model` on `cluster` with `method` (see the module docstring).

    compute_s: one GPU's fwd+bwd time per step; None = batch / throughput (the cluster's, else
    the model's default).
    """
    if isinstance(model, str):
        model = load(model)
    n = cluster.gpus
    if compute_s is None:
        compute_s = model.batch / (cluster.throughput or model.throughput)
    slow = 1.0 + cluster.straggler_cv * math.sqrt(2 * math.log(n)) if n > 1 else 1.0
    fwd = model.forward_fraction * compute_s * slow  # the slowest of n GPUs sets the pace
    bwd = compute_s * slow - fwd
    msgs = plan(model, method, bwd) if n > 1 else []
    costs = [message_cost(cluster, method, m) for m in msgs]
    overhead = sum(c[1] for c in costs)
    bwd_end = fwd + bwd + overhead
    ready = [bwd_end if not method.overlap else fwd + m.ready * (bwd + overhead) for m in msgs]
    done = [0.0] * len(msgs)
    todo = list(range(len(msgs)))
    t = 0.0
    while todo:
        avail = [i for i in todo if ready[i] <= t]
        if not avail:
            t = min(ready[i] for i in todo)
            continue
        i = min(avail, key=lambda j: (msgs[j].fwd_index, j)) if method.priority else avail[0]
        todo.remove(i)
        t = max(t, ready[i]) + costs[i][0]
        done[i] = t
    comm_end = max(done, default=0.0)
    if method.forward_gating and msgs:
        need: dict[str, float] = {}
        for m, d in zip(msgs, done):
            for name in m.layers:
                need[name] = max(need.get(name, 0.0), d)
        total = sum(layer.fwd_share for layer in model.layers) or 1.0
        t = bwd_end
        for layer in sorted(model.layers, key=lambda x: x.fwd_index):
            t = max(t, need.get(layer.name, 0.0)) + layer.fwd_share / total * fwd
        step = t - fwd
    else:
        step = max(bwd_end, comm_end)
    speedup = n * compute_s / step
    epoch = model.dataset / (n * model.batch) * step
    return Result(
        model=model.name, method=method.name, gpus=n, gpus_per_node=cluster.gpus_per_node,
        batch=model.batch, step_s=step, compute_s=compute_s, overhead_s=overhead,
        comm_s=sum(c[0] for c in costs), exposed_comm_s=max(0.0, step - bwd_end),
        speedup=speedup, scaling_efficiency=speedup / n, throughput=n * model.batch / step,
        epoch_time_s=epoch, train_time_s=epoch * model.epochs,
        wire_bytes=sum(c[2] for c in costs), messages=len(msgs))

