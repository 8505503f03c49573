"""End-to-end training step time on an emulated cluster network: what compression buys.

    python -m benchmarks.bench_e2e --quick                 # tiny model, loopback, seconds
    python -m benchmarks.bench_e2e                         # AlexNet + ResNet-50, 2 ranks, all tiers
    python -m benchmarks.bench_e2e --ranks 2,4 --models resnet50 --tiers 1,10

Each rank is a process with one thread, in its own network namespace behind a tbf-shaped veth
into a bridge (see benchmarks/netem.py); inputs are synthetic (ResNet-50: batch 4 of 64x64) so
that a step fits one core. Within one launch every variant is built up front and the variants
are run in interleaved rounds, so ratios are measured side by side under the same load.

Variants: the limit (`nocomm`: the same step with no communication), DDP on gloo, DDP with
PyTorch's fp16_compress_hook, powerSGD_hook rank 2 (one bucket: its chained allreduces race
across buckets on gloo), and, when gradientflow's backend and hooks import, gradientflow dense,
FP16 and CSC at 10%, 1%, 0.1% (DDP hooks), and the DistributedOptimizer with priority scheduling
(`gf_opt`: Horovod-style, no DDP; `gf_opt_csc1`: the same with CSC 1%). The gradientflow
variants run in a second launch with their own DDP and nocomm anchors, so a fault there cannot
cost the peers' figures. Every variant's model is built up front in every rank; when that would
not fit the machine's available memory (AlexNet's 61 M parameters, 4 ranks), a group is split
into several launches, each with its own anchors (see `_split_for_memory`).

Reported per model, ranks and tier: median and p95 step time (max over ranks of each step),
communication time (step minus the no-communication step), bytes each rank sent per step
(the NIC's tx counter), speedup over DDP-on-gloo, the measured communication-to-computation
ratio of DDP, and scaling efficiency = throughput at n ranks / (n x throughput at 1 rank).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run by path: make benchmarks.* importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (
    fmt,
    line_plot,
    machine_info,
    machine_line,
    markdown_table,
    median,
    p95,
    results_dir,
    thread_cpu_seconds,
    write_result,
)

NAME = "e2e"
PEERS = ("nocomm", "ddp", "fp16_hook", "powersgd")
GF_VARIANTS = ("gf_dense", "gf_fp16", "gf_csc10", "gf_csc1", "gf_csc0.1", "gf_opt", "gf_opt_csc1")
LABELS = {
    "nocomm": "no communication (limit)", "ddp": "DDP gloo",
    "ddp_noop": "DDP, a hook that sends nothing (DDP's own cost)",
    "fp16_hook": "DDP + fp16_compress_hook",
    "powersgd": "DDP + powerSGD_hook r2", "gf_dense": "gradientflow dense",
    "gf_fp16": "gradientflow FP16", "gf_csc10": "gradientflow CSC 10%",
    "gf_csc1": "gradientflow CSC 1%", "gf_csc0.1": "gradientflow CSC 0.1%",
    "gf_csc1_pool": "gradientflow CSC 1%, pool selection",
    "gf_csc1_unfused": "gradientflow CSC 1%, unfused (each bucket alone)",
    "gf_csc1_t32": "gradientflow CSC 1%, fusion threshold 32 MB",
    "gf_opt": "gradientflow DistributedOptimizer, priority",
    "gf_opt_csc1": "gradientflow DistributedOptimizer, priority, CSC 1%",
    "gf_opt_csc1_nf": "gradientflow DistributedOptimizer, priority, CSC 1%, next-forward "
                      "overlap",
}
# Bytes of memory per model parameter each variant holds in a rank (FP32: weights, gradients,
# DDP's bucket copy, the compressors' residual and its spare, FP16's wire buffer): what decides
# how many variants one launch can build side by side.
_BYTES_PER_PARAM = {"nocomm": 8, "ddp": 12, "ddp_noop": 12, "fp16_hook": 14, "powersgd": 12,
                    "gf_dense": 12, "gf_fp16": 22, "gf_csc10": 20, "gf_csc1": 20, "gf_csc0.1": 20,
                    "gf_opt": 12, "gf_opt_csc1": 20, "gf_opt_csc1_nf": 24}
# Issue 7's reference figures: ResNet-50, 2 ranks, batch 4 of 64x64, one thread per rank,
# median step ms measured on an unloaded machine of this kind; CSC rows are target speedups.
TARGETS = {
    1.0: {"ddp": 963, "fp16_hook": 531, "powersgd": 459, "nocomm": 225, "gf_csc1": 3.2},
    10.0: {"ddp": 377, "fp16_hook": 401, "powersgd": 459, "nocomm": 216, "gf_csc1": 1.35},
}
# Defaults chosen so that one step fits one core of this machine in a fraction of a second.
MODELS = {"resnet50": {"batch": 4, "image": 64}, "alexnet": {"batch": 8, "image": 64},
          "tiny": {"batch": 8, "image": 16},
          # The Fashion-MNIST comparison's two shapes (experiments/imagenet/models.py) at its
          # batch per rank: their steps measured apart from the training loop.
          "alexnet_shaped": {"batch": 64, "image": 28, "channels": 1},
          "resnet_shaped": {"batch": 64, "image": 28, "channels": 1}}
_FASHION_MODELS = str(Path(__file__).resolve().parents[1] / "experiments" / "imagenet")


# ---- rank side ---------------------------------------------------------------------------------

def _build_model(name: str):
    import torch
    if name == "tiny":
        return torch.nn.Sequential(
            # BatchNorm as in ResNet: DDP then broadcasts its buffers every forward.
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(4),
            torch.nn.Flatten(), torch.nn.Linear(256, 128), torch.nn.ReLU(),
            torch.nn.Linear(128, 10))
    if name.endswith("_shaped"):
        if _FASHION_MODELS not in sys.path:
            sys.path.insert(0, _FASHION_MODELS)
        import models

        return getattr(models, name)(num_classes=10)
    import torchvision
    return getattr(torchvision.models, name)(weights=None)


def _nic_tx_bytes(ifname: str) -> int:
    # /proc/net/dev is per network namespace, so inside a rank namespace this is the rank's NIC.
    with open("/proc/net/dev") as f:
        for line in f:
            if ":" in line and line.split(":", 1)[0].strip() == ifname:
                return int(line.split(":", 1)[1].split()[8])
    return 0


def _gf_config(method: str, density: float, **extra):
    from gradientflow.compression import CompressionConfig, lookup
    kw = {"method": method, **extra}
    names = lookup(method).options.names()
    if method == "csc":
        kw["density"] = density
    if "warmup_densities" in names:
        kw["warmup_densities"] = ()  # measure the target density, not the warm-up ramp
    return CompressionConfig(**kw)


def _threshold_of(variant: str) -> int | None:
    """The fusion threshold a variant's own group takes (bytes), None: the shared group.

    `..._unfused`: 0, every bucket its own op with its own collectives; `..._t<MB>`: MB MiB.
    """
    tag = variant.rsplit("_", 1)[-1]
    if tag == "unfused":
        return 0
    if tag.startswith("t") and tag[1:].isdigit():
        return int(tag[1:]) * 2**20
    return None


def _make_variant(variant: str, model_name: str, gf_group, bucket_view: bool = False,
                  groups: dict | None = None, broadcast_buffers: bool = True):
    """Return the module to train for one variant; raises with a reason to skip it.

    `..._pool`: CSC choosing chunks across each fused batch; a variant with a threshold of its own
    (`_threshold_of`) runs on its group in `groups` (by threshold).
    bucket_view: DDP's gradient_as_bucket_view for every DDP variant (peers and ours alike):
    gradients live in the buckets, which saves DDP's two copies of the gradient per step
    (into the bucket during backward, and the hook's result back into .grad).
    broadcast_buffers: False leaves out DDP's synchronous broadcast of rank 0's buffers (BN
    running statistics) before each forward, for every DDP variant alike, as Horovod does (it
    broadcasts them once, at the start): `_no_forward_buffer_sync`.
    """
    import functools

    import torch
    from torch.nn.parallel import DistributedDataParallel

    DDP = functools.partial(DistributedDataParallel, gradient_as_bucket_view=bucket_view,
                            **({} if broadcast_buffers else _no_forward_buffer_sync()))

    torch.manual_seed(0)  # every variant starts from the same weights
    model = _build_model(model_name)
    if variant == "nocomm":
        return model
    if variant == "ddp":
        return DDP(model)
    if variant == "ddp_noop":
        # DDP as the gradientflow variants run it (their group, their buffer broadcasts), with
        # nothing sent for the gradients: what DDP itself adds to the limit.
        from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

        ddp = DDP(model, process_group=gf_group)
        ddp.register_comm_hook(None, noop_hook)
        return ddp
    if variant == "fp16_hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp = DDP(model)
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return ddp
    if variant == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        # One bucket: chained allreduces of several buckets race on gloo (collective mismatch).
        ddp = DDP(model, bucket_cap_mb=4096)
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                   start_powerSGD_iter=2)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
        return ddp
    if variant.startswith("gf_opt"):
        return model  # averaged by its optimizer (_make_optimizer), not by DDP
    if variant.startswith("gf_"):
        thr = _threshold_of(variant)
        # gf_dense has no hook; the others' is registered with their optimizer (_make_optimizer)
        return DDP(model, process_group=gf_group if thr is None else groups[thr])
    raise ValueError(f"bench_e2e: unknown variant {variant!r}; use one of {list(LABELS)}")


def _no_forward_buffer_sync() -> dict:
    """DDP's argument that leaves out the broadcast of rank 0's buffers before each forward:
    `forward_sync_buffers=False` from torch 2.14 on (it still syncs them once, at construction;
    `broadcast_buffers` is deprecated there), `broadcast_buffers=False` before."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def _hook_config(variant: str):
    """The compression config of a gradientflow DDP-hook variant, None for the others."""
    if variant == "gf_fp16":
        return _gf_config("fp16", 1.0)
    if variant.startswith("gf_csc"):
        density, *tags = variant[len("gf_csc"):].split("_")
        extra = {"selection": "pool"} if "pool" in tags else {}
        return _gf_config("csc", float(density) / 100, **extra)
    return None


def _make_optimizer(variant: str, model, gf_group, momentum: float = 0.0):
    """Return the optimizer of one variant: SGD, or gradientflow's DistributedOptimizer.

    A gradientflow hook variant's hook is registered here. With momentum, it is registered
    with the optimizer, as a user would: the residual follows its learning rate, and the
    optimizer applies the momentum (CSC's default; under momentum correction it would move into
    the compressor), so every variant applies the same momentum once. Without, it is
    registered alone: plain error feedback.
    """
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=momentum)
    cfg = _hook_config(variant)
    if cfg is not None:
        import gradientflow.hooks as gfh

        gfh.register(model, cfg, optimizer=opt if momentum else None)
    if not variant.startswith("gf_opt"):
        return opt
    import gradientflow.optim as gfo

    # Priority scheduling on (the default, said explicitly): the partition the next forward
    # needs first is launched first; the public API only, as a user would call it. "_nf":
    # step() returns at once and each module's update waits for its next forward.
    compression = _gf_config("csc", 0.01) if variant.startswith("gf_opt_csc1") else None
    return gfo.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                    compression=compression, process_group=gf_group, priority=True,
                                    overlap_next_forward=variant.endswith("_nf"))


def worker(rank: int, world_size: int, model: str, batch: int, image: int, variants: list,
           steps: int, rounds: int, warmup: int, ifname: str, bucket_view: bool = False,
           momentum: float = 0.0, broadcast_buffers: bool = True,
           mark_steps: bool = False) -> dict:
    """One rank: build every variant, run them in interleaved rounds, return per-step times.

    momentum: every variant's SGD momentum (0: plain SGD, whose step has no momentum pass;
    CSC then runs plain error feedback).
    mark_steps: mark each step on gradientflow's timeline (`gradientflow.mark_step`).
    Also returned: each thread's CPU ms per timed step, per variant (`thread_cpu_ms`)."""
    import torch
    import torch.distributed as dist

    gf_group, groups, skipped = None, {}, {}
    if any(v.startswith("gf_") for v in variants):
        try:
            import gradientflow  # noqa: F401  (registers the backend)
            gf_group = dist.new_group(backend="gradientflow")
            for thr in dict.fromkeys(_threshold_of(v) for v in variants):
                if thr is not None:  # in variant order: the same on every rank
                    groups[thr] = dist.new_group(backend="gradientflow",
                                                 pg_options={"fusion_threshold": thr})
        except Exception as exc:  # noqa: BLE001 - any failure means: skip, say why
            skipped.update({v: f"gradientflow backend: {type(exc).__name__}: {exc}"
                            for v in variants if v.startswith("gf_")})
    runners = {}
    for v in variants:
        if v in skipped:
            continue
        try:
            runners[v] = _make_variant(v, model, gf_group, bucket_view, groups,
                                       broadcast_buffers)
        except Exception as exc:  # noqa: BLE001
            skipped[v] = f"{type(exc).__name__}: {exc}"
    torch.manual_seed(1 + rank)  # each rank its own data shard
    x = torch.randn(batch, MODELS[model].get("channels", 3), image, image)
    y = torch.randint(0, 10, (batch,))
    loss_fn = torch.nn.CrossEntropyLoss()
    opts = {}
    for v in list(runners):
        try:
            opts[v] = _make_optimizer(v, runners[v], gf_group, momentum)
        except Exception as exc:  # noqa: BLE001 - skip the variant, say why
            skipped[v] = f"{type(exc).__name__}: {exc}"
            del runners[v]

    mark_step = None
    if mark_steps:
        from gradientflow import mark_step
    marked = itertools.count()

    def step(v):
        m, opt = runners[v], opts[v]
        if mark_step is not None:
            mark_step(next(marked))
        opt.zero_grad(set_to_none=False)
        loss_fn(m(x), y).backward()
        opt.step()

    times = {v: [] for v in runners}
    cpu = {v: [] for v in runners}  # process CPU seconds per step: all of the rank's threads
    tx = dict.fromkeys(runners, 0)
    for v in runners:  # warm-up (powerSGD needs start_powerSGD_iter=2 steps before compressing)
        for _ in range(warmup):
            step(v)
    # The link as achieved in this launch, under this launch's CPU load (tbf shapes bytes, but
    # gloo on a busy core may not even reach the tier): a 16 MB allreduce, median of 3.
    probe = torch.ones(4 * 2**20)
    probe_t = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(probe)
        probe_t.append(time.perf_counter() - t0)
    busbw = (2 * (world_size - 1) / world_size * probe.numel() * 4 * 8 / median(probe_t) / 1e9
             if world_size > 1 else None)
    del probe
    floor_ms = _error_feedback_floor_ms(sum(p.numel() for p in next(iter(runners.values()))
                                            .parameters())) if runners else None
    per_round = max(1, steps // rounds)
    engine = {v: dict.fromkeys(ENGINE_STATS, 0.0) for v in runners if v.startswith("gf_")}
    threads = {v: {} for v in runners}
    for _ in range(rounds):
        for v in runners:
            dist.barrier()
            b0 = _nic_tx_bytes(ifname)
            s0 = _engine_stats() if v in engine else None
            th0 = _thread_cpu()
            for _ in range(per_round):
                t0, c0 = time.perf_counter(), time.process_time()
                step(v)
                times[v].append(time.perf_counter() - t0)
                cpu[v].append(time.process_time() - c0)
            for name, sec in _thread_cpu().items():
                got = (sec - th0.get(name, 0.0)) * 1e3 / per_round / rounds
                threads[v][name] = threads[v].get(name, 0.0) + got
            tx[v] += _nic_tx_bytes(ifname) - b0
            if s0 is not None:
                s1 = _engine_stats()
                for k in ENGINE_STATS:
                    engine[v][k] += (s1[k] - s0[k]) / per_round / rounds
    n_params = {v: sum(p.numel() for p in m.parameters()) for v, m in runners.items()}
    return {"times": times, "cpu": cpu, "tx_bytes": tx,
            "steps": {v: len(t) for v, t in times.items()},
            "skipped": skipped, "params": n_params, "probe_busbw_gbps": busbw,
            "ef_floor_ms": floor_ms, "engine": engine, "thread_cpu_ms": threads}


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads so far, by name (common.thread_cpu_seconds), a
    group's number left out of Python's names ('engine', 'reaper')."""
    import re

    return thread_cpu_seconds(lambda name: re.sub(r"^\d+-", "", name))


# gradientflow.stats() counters reported per step for the gradientflow variants: collectives
# handed to the transport, engine-thread time compressing/decompressing, time collectives were
# in flight, agreement rounds and their time.
ENGINE_STATS = ("fused_operations", "codec_time_s", "comm_time_s", "agreement_rounds",
                "agreement_time_s")


def _engine_stats() -> dict:
    import gradientflow

    s = gradientflow.stats()
    return {k: float(s.get(k) or 0.0) for k in ENGINE_STATS}


def _error_feedback_floor_ms(numel: int, reps: int = 5) -> float:
    """The least memory work any error-feedback compressor does per step, in ms (the fastest of
    `reps`: a floor, so page faults and a busy moment of the other rank are left out).

    Whatever it selects, it must add the gradient into its residual (read two, write one
    FP32 copy of the model) and leave the gradient buckets rewritten (write one more); CSC's
    one-pass kernel does exactly these two passes plus the chunk norms. Measured here, on this
    rank's thread, while the other ranks measure too (as they compress at the same time).
    """
    import torch

    g, r = torch.ones(numel), torch.zeros(numel)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        r.add_(g)
        g.zero_()
        times.append(time.perf_counter() - t0)
        g.fill_(1.0)
    return min(times) * 1e3


# ---- driver ------------------------------------------------------------------------------------

def _gf_available() -> str:
    """'' when gradientflow's backend and hooks import, else the reason they do not."""
    try:
        import gradientflow.backend.backend  # noqa: F401
        import gradientflow.hooks as gfh
        from gradientflow.compression import CompressionConfig  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    if not hasattr(gfh, "register"):
        return "gradientflow.hooks.register is not defined yet"
    return ""


def launch_worker(n: int, kwargs: dict, variants: list, cluster, timeout_s: float,
                  notes: list, what: str, log=print, env_extra: dict | None = None):
    """Run `worker` for `variants` on `n` ranks of `cluster`; return the launch's result, or
    None after adding a note and a log line naming `what` failed."""
    from benchmarks.launch import launch

    res = launch("benchmarks.bench_e2e:worker", n,
                 {**kwargs, "variants": variants, "ifname": cluster.ifname},
                 cluster=cluster, timeout_s=timeout_s, env_extra=env_extra)
    if not res.ok:
        notes.append(f"{what} {variants}: {res.error}")
        log(f"FAILED {what}: {res.error}")
        return None
    return res


def _summarise(res, variants, world_size, model, tier_label, shaped, batch):
    """Turn one launch's per-rank results into rows (one per variant)."""
    rows, r0 = [], res.results[0]
    for v in variants:
        if v in r0["skipped"]:
            rows.append({"model": model, "ranks": world_size, "tier": tier_label, "variant": v,
                         "label": LABELS[v], "skipped": r0["skipped"][v]})
            continue
        per_rank = [r["times"][v] for r in res.results]
        step_times = [max(ts) for ts in zip(*per_rank)]  # a step ends when its slowest rank does
        tx = [r["tx_bytes"][v] / max(r["steps"][v], 1) for r in res.results]
        rows.append({"model": model, "ranks": world_size, "tier": tier_label, "variant": v,
                     "label": LABELS[v], "link_gbps": r0.get("probe_busbw_gbps"),
                     "median_ms": median(step_times) * 1e3,
                     "p95_ms": p95(step_times) * 1e3, "n_steps": len(step_times),
                     # CPU the rank's process spent per step (median over steps, mean over
                     # ranks): the work a variant costs, which other load inflates far less
                     # than wall time (it still pays for cache misses and spinning threads).
                     "cpu_ms": (sum(median(r["cpu"][v]) for r in res.results) / len(res.results)
                                * 1e3 if all("cpu" in r for r in res.results) else None),
                     # On loopback every rank shares `lo`: its counter holds all ranks' bytes.
                     "wire_MB_per_step": (median(tx) if shaped else median(tx) / world_size) / 1e6,
                     "params": r0["params"][v], "batch": batch,
                     "ef_floor_ms": max((r.get("ef_floor_ms") or 0.0 for r in res.results),
                                        default=None) or None})
    by = {r["variant"]: r for r in rows if "median_ms" in r}
    base, limit = by.get("ddp"), by.get("nocomm")
    for r in rows:
        if "median_ms" not in r:
            continue
        if limit and r.get("cpu_ms") is not None and limit.get("cpu_ms") is not None:
            r["extra_cpu_ms"] = r["cpu_ms"] - limit["cpu_ms"]
        if limit:
            r["comm_ms"] = max(r["median_ms"] - limit["median_ms"], 0.0)
            r["comm_to_comp"] = r["comm_ms"] / limit["median_ms"]
        if base:
            r["speedup_vs_ddp"] = base["median_ms"] / r["median_ms"]
    return rows


def _model_params(model: str) -> int:
    """Parameter count of a benchmark model, built on the meta device (no memory)."""
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in _build_model(model).parameters())


def _available_bytes() -> int | None:
    """MemAvailable of this machine (None where /proc/meminfo cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _split_for_memory(group: list, params: int, world_size: int, available: int | None,
                      share: float = 0.6) -> list[list]:
    """Split one launch's variants so that every rank's models fit `share` of the free memory.

    Each part keeps the group's nocomm/ddp anchors (speedups are always against the DDP of the
    same launch), so splitting costs time, never comparability. Why: AlexNet (61 M parameters)
    with every gradientflow variant built side by side needs ~7 GB per rank, too much for 4
    ranks on this 24 GB machine (other work shares it too).
    """
    if available is None:
        return [group]
    anchors = [v for v in group if v in ("nocomm", "ddp")]
    rest = [v for v in group if v not in anchors]
    budget = share * available / world_size
    base = sum(_BYTES_PER_PARAM.get(v, 20) for v in anchors) * params
    parts, cur, used = [], [], base
    for v in rest:
        need = _BYTES_PER_PARAM.get(v, 20) * params
        if cur and used + need > budget:
            parts.append(anchors + cur)
            cur, used = [], base
        cur.append(v)
        used += need
    if cur or not parts:
        parts.append(anchors + cur)
    return parts


def run(models, ranks_list, tiers, steps, rounds, warmup, timeout_s, loopback, log=print,
        gradientflow=True, only=None, bucket_view=False):
    """Measure every (model, ranks, tier); return (rows, tier_rows, single_rank, notes)."""
    from benchmarks.launch import launch
    from benchmarks.netem import Cluster, ShapeConfig

    rows, notes, single = [], [], {}
    gf_reason = _gf_available() if gradientflow else "not requested (--no-gradientflow)"
    groups = [list(PEERS)]
    if gf_reason:
        notes.append(f"gradientflow variants skipped: {gf_reason}")
    else:
        groups.append(["nocomm", "ddp", *GF_VARIANTS])
    if only:  # keep the nocomm/ddp anchors of every group that still has a variant asked for
        groups = [[v for v in g if v in ("nocomm", "ddp") or v in only] for g in groups]
        groups = [g for g in groups if any(v in only for v in g)]
    for model in models:
        cfg = MODELS[model]
        common = {"model": model, "batch": cfg["batch"], "image": cfg["image"],
                  "steps": steps, "rounds": rounds, "warmup": warmup, "bucket_view": bucket_view}
        # One rank alone (no contention, no communication): the scaling-efficiency reference.
        res = launch("benchmarks.bench_e2e:worker", 1,
                     {**common, "variants": ["nocomm"], "ifname": "lo"}, timeout_s=timeout_s)
        if res.ok:
            single[model] = median(res.results[0]["times"]["nocomm"]) * 1e3
            log(f"[e2e] {model} 1 rank: {single[model]:.1f} ms/step")
        else:
            notes.append(f"{model} single-rank run failed: {res.error}")
        for n in ranks_list:
            for rate in tiers:
                shape = ShapeConfig(rate_gbps=rate)
                if loopback:  # no namespaces at all: every rank on this machine's loopback
                    cluster = Cluster(n, shape)
                    cluster.tag, cluster.shaped, cluster.reason = "loopback", False, "requested"
                    ctx = contextlib.nullcontext(cluster)
                else:
                    ctx = Cluster(n, shape, allow_fallback=True)
                with ctx as cluster:
                    if rate is not None and not cluster.shaped:
                        notes.append(f"{shape.label} not emulated ({cluster.reason}): skipped")
                        continue
                    launches = []
                    params, avail = _model_params(model), _available_bytes()
                    for g in groups:
                        parts = _split_for_memory(g, params, n, avail)
                        if len(parts) > 1:
                            notes.append(f"{model} {n} ranks: {g[2:]} ran in {len(parts)} launches "
                                         f"(each with its own nocomm/DDP anchors) so every rank's "
                                         f"models fit {avail / 2**30:.1f} GiB of free memory")
                        launches += parts
                    for variants in launches:
                        t0 = time.monotonic()
                        label = shape.label if cluster.shaped else "loopback"
                        res = launch_worker(n, common, variants, cluster, timeout_s, notes,
                                            f"{model} {n} ranks {label}", log)
                        if res is None:
                            continue
                        got = _summarise(res, variants, n, model, label, cluster.shaped,
                                         cfg["batch"])
                        load1 = os.getloadavg()[0]  # other work on this machine shares the cores
                        for r in got:
                            r["rate_gbps"] = rate
                            r["load1"] = load1
                            gf = any(x.startswith("gf_") for x in variants)
                            r["group"] = "gradientflow" if gf else "peers"
                            if model in single and "median_ms" in r:
                                r["scaling_eff"] = single[model] / r["median_ms"]
                        rows.extend(got)
                        log(f"[e2e] {model} n={n} {label} ({time.monotonic() - t0:.0f} s): " +
                            ", ".join(f"{r['variant']} {fmt(r.get('median_ms'))} ms"
                                      for r in got))
    return rows, single, notes


def _markdown(rows, single, notes, tier_rows, cmd, quick, machine=None):
    out = [f"## End-to-end step time on an emulated cluster (`{NAME}`)", "",
           machine_line(machine),
           f"Command: `{cmd}`" + (" (quick mode: plumbing only)" if quick else ""),
           "",
           "Median step time over interleaved rounds (each step: the slowest rank); comm = step "
           "minus the no-communication step of the same run; wire = bytes each rank's NIC sent "
           "per step; speedup over DDP on gloo measured in the same launch; scaling efficiency = "
           "throughput at n ranks / (n x throughput of one rank alone). CPU ms over nocomm = "
           "the process CPU time per step of a rank (all its threads) minus the "
           "no-communication step's: what the variant's communication costs the rank's core "
           "(compression, DDP's copies, the transport), which other load inflates far less than "
           "wall time. One thread per rank. "
           "Load avg = the machine's 1-minute load average after the launch. It counts this "
           "benchmark's own ranks (about one runnable thread per rank, more while gloo, the "
           "engine and the compressor work at once), so only a load above cores + ranks means "
           "other work shared the cores and slowed every variant of that launch alike.", ""]
    nproc = (machine or machine_info())["nproc"] or 1
    # Only load beyond what the launch's own ranks make counts as other work (an idle machine
    # running 2 ranks reads 1.1-3.3 here).
    over = [r["load1"] - r["ranks"] for r in rows if r.get("load1") is not None]
    if over and max(over) > nproc:
        loads = [r["load1"] for r in rows if r.get("load1") is not None]
        out += [f"**Loaded machine: the 1-minute load average was {min(loads):.1f} to "
                f"{max(loads):.1f} on {nproc} cores during these launches, more than this "
                "benchmark's own ranks make.** Other processes shared the ranks' cores, so "
                "computation (and gloo's own CPU work, and any compression arithmetic) ran slower "
                "than on an idle machine and the network mattered correspondingly less. Ratios "
                "within one launch are still side by side, but do not read these as the speedups "
                "users would see: re-run `make bench` on an idle machine.", ""]
    if any(r["ranks"] > 2 for r in rows):
        out += [f"**More than 2 ranks share this machine's cores** ({machine_info()['nproc']} "
                "cores): those figures include CPU contention (efficiency at most about "
                "cores/ranks).", ""]
    if tier_rows:
        out += ["### Tiers as measured (gloo allreduce, 2 ranks)", "",
                markdown_table(["tier", "allreduce_ms", "busbw_gbps"], tier_rows,
                               ["tier", "64 MB allreduce ms", "bus bandwidth Gbit/s"]), ""]
    for model in dict.fromkeys(r["model"] for r in rows):
        for n in sorted({r["ranks"] for r in rows if r["model"] == model}):
            sub = [r for r in rows if r["model"] == model and r["ranks"] == n]
            p = sub[0].get("params")
            head = f"### {model}, {n} ranks"
            if p:
                head += (f" ({p / 1e6:.2f} M parameters = {p * 4 / 1e6:.1f} MB of FP32 gradients,"
                         f" batch {sub[0].get('batch')}")
                head += f"; one rank alone {single[model]:.0f} ms/step)" if model in single else ")"
            out += [head, ""]
            ratio = [r for r in sub if r["variant"] == "ddp" and r.get("group") == "peers"]
            if ratio:
                out += ["DDP communication-to-computation ratio (and the 16 MB allreduce bus "
                        "bandwidth achieved in the same launch): " + ", ".join(
                            f"{r['tier']} {fmt(r.get('comm_to_comp'))}x "
                            f"({fmt(r.get('link_gbps'))} Gbit/s)" for r in ratio), ""]
            floors = [r["ef_floor_ms"] for r in sub if r.get("ef_floor_ms")]
            if floors:
                out += [f"Error-feedback floor: {fmt(median(floors))} ms per step (median over "
                        "launches) of memory work that any compressor with a residual does on "
                        "this core: the gradient added into the residual and the buckets "
                        "rewritten. It bounds what compression can save here.", ""]
            out += [markdown_table(
                ["tier", "label", "median_ms", "p95_ms", "comm_ms", "extra_cpu_ms",
                 "wire_MB_per_step", "speedup_vs_ddp", "scaling_eff", "load1", "skipped"], sub,
                ["tier", "variant", "median ms", "p95 ms", "comm ms", "CPU ms over nocomm",
                 "wire MB/step/rank", "speedup vs DDP", "scaling eff.", "load avg", "note"]), ""]
    out += _targets_section(rows)
    if notes:
        out += ["Notes:", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(out)


def _targets_section(rows) -> list[str]:
    """Measured ResNet-50 2-rank figures beside issue 7's targets (empty when not measured)."""
    table = []
    for rate, targets in TARGETS.items():
        base = targets["ddp"]
        for v, target in targets.items():
            got = next((r for r in rows if r["model"] == "resnet50" and r["ranks"] == 2
                        and r.get("rate_gbps") == rate and r["variant"] == v
                        and "median_ms" in r), None)
            is_speedup = v.startswith("gf_")
            table.append({
                "tier": f"{rate:g} Gbps", "label": LABELS[v],
                "target_ms": None if is_speedup else float(target),
                "target_x": float(target) if is_speedup else base / target,
                "median_ms": got and got["median_ms"], "speedup_vs_ddp": got and
                got.get("speedup_vs_ddp"), "load1": got and got.get("load1"),
                "met": _met(got, float(target), is_speedup)})
    if not any(t["median_ms"] for t in table):
        return []
    return ["### Against issue 7's targets (ResNet-50, 2 ranks)", "",
            "Targets were measured on an unloaded machine of this kind with a faster step "
            "(225 and 216 ms with no communication, against the no-communication rows here); "
            "compare speedups (measured side by side) rather than milliseconds.", "",
            markdown_table(["tier", "label", "target_ms", "target_x", "median_ms",
                            "speedup_vs_ddp", "load1", "met"], table,
                           ["tier", "variant", "target ms", "target speedup", "measured ms",
                            "measured speedup", "load avg", "met"]),
            ""]


def _met(got: dict | None, target: float, is_speedup: bool) -> str:
    """"yes" or "no" against the target (a speedup over DDP, or a step time); "-" if not run."""
    if not got or got.get("median_ms") is None:
        return "-"
    if is_speedup:
        ok = got.get("speedup_vs_ddp") is not None and got["speedup_vs_ddp"] >= target
    else:
        ok = got["median_ms"] <= target
    return "yes" if ok else "no"


def _plotted(row) -> bool:
    """Whether a row belongs on a plot: the gradientflow launch's own DDP/nocomm anchors
    would duplicate the peers' lines, so only its gradientflow variants are drawn."""
    return row.get("group") != "gradientflow" or row["variant"].startswith("gf_")


def _plot(rows, out_dir):
    paths = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for n in sorted({r["ranks"] for r in rows if r["model"] == model}):
            sub = [r for r in rows if r["model"] == model and r["ranks"] == n
                   and r.get("rate_gbps") is not None and "median_ms" in r and _plotted(r)]
            series = {}
            for r in sub:
                xs, ys = series.setdefault(LABELS[r["variant"]], ([], []))
                xs.append(r["rate_gbps"])
                ys.append(r["median_ms"])
            if series:
                p = line_plot(Path(out_dir) / f"e2e_{model}_{n}ranks.png", series,
                              "link rate (Gbit/s, tbf both directions)", "median step time (ms)",
                              f"{model}, {n} ranks: step time vs bandwidth", logx=True)
                if p:
                    paths.append(p.name)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model on loopback: seconds")
    ap.add_argument("--out", default=results_dir("e2e"), help="directory for e2e.json/.md")
    ap.add_argument("--models", default=None, help="comma list of alexnet,resnet50,tiny")
    ap.add_argument("--ranks", default=None, help="comma list of rank counts (default 2; 2,4)")
    ap.add_argument("--tiers", default=None,
                    help="comma list of Gbit/s, 'none' = unshaped (default none,1,2.5,5,10)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per variant")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the variants")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=None, help="seconds per launch")
    ap.add_argument("--loopback", action="store_true", help="no namespaces: unshaped loopback")
    ap.add_argument("--variants", default=None,
                    help=f"comma list to run (with the nocomm/ddp anchors): {','.join(LABELS)}")
    ap.add_argument("--no-gradientflow", action="store_true",
                    help="measure the peers only (gradientflow variants not even launched)")
    ap.add_argument("--from-json", default=None,
                    help="run nothing: re-render the markdown and plots from an e2e.json")
    ap.add_argument("--no-tier-probe", action="store_true", help="skip measuring the tiers")
    ap.add_argument("--bucket-view", action="store_true",
                    help="DDP(gradient_as_bucket_view=True) for every DDP variant: no gradient "
                         "copies into and out of the buckets (default: DDP's default, False)")
    args = ap.parse_args(argv)
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        md = _markdown(data["rows"], data["single_rank_ms"], data["notes"], data["tiers"],
                       data["command"], data["quick"], data.get("machine"))
        plots = [] if data["quick"] else _plot(data["rows"], args.out)
        if plots:
            md += "\n" + "\n".join(f"![{p}]({p})" for p in plots) + "\n"
        data.pop("name", None)  # the original "machine" stays: it is where the numbers come from
        data["plots"] = plots
        write_result(args.out, NAME, data, md)
        print(md)
        return 0
    q = args.quick
    models = (args.models or ("tiny" if q else "resnet50,alexnet")).split(",")
    ranks = [int(x) for x in (args.ranks or "2").split(",")]
    tiers_s = args.tiers or ("none" if q else "none,1,2.5,5,10")
    tiers = [None if t.strip().lower() in ("none", "unshaped", "") else float(t)
             for t in tiers_s.split(",")]
    if q and args.tiers is None:
        tiers = [None]
    steps = args.steps or (3 if q else 15)
    rounds = min(args.rounds, steps) if not q else 1
    timeout = args.timeout or (90.0 if q else 600.0)
    cmd = "python -m benchmarks.bench_e2e " + " ".join(argv if argv is not None else sys.argv[1:])
    tier_rows = []
    if not q and not args.loopback and not args.no_tier_probe and any(t is not None for t in tiers):
        from benchmarks.netem import measure_tiers
        tier_rows = measure_tiers(tiers=tiers, world_size=2)
        for t in tier_rows:
            print(f"[e2e] tier {t['tier']}: {fmt(t['busbw_gbps'])} Gbit/s", flush=True)
    loopback = q or args.loopback
    if loopback:
        tiers = [None]
    rows, single, notes = run(models, ranks, tiers, steps, rounds, args.warmup, timeout, loopback,
                              log=lambda s: print(s, flush=True),
                              gradientflow=not args.no_gradientflow,
                              only=args.variants.split(",") if args.variants else None,
                              bucket_view=args.bucket_view)
    md = _markdown(rows, single, notes, tier_rows, cmd.strip(), q)
    plots = [] if q else _plot(rows, args.out)
    if plots:
        md += "\n" + "\n".join(f"![{p}]({p})" for p in plots) + "\n"
    write_result(args.out, NAME, {"command": cmd.strip(), "quick": q, "rows": rows,
                                  "single_rank_ms": single, "tiers": tier_rows, "notes": notes,
                                  "plots": plots}, md)
    print(md)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
