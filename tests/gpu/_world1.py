"""The gradientflow backend on one GPU (world_size 1, NCCL underneath): every check, one process.

Run by test_nccl.py (and benchmarks/gpu_check.py) as ``python _world1.py RESULT.json``; writes
one record per check (name, ok, seconds, error with the traceback's tail, details) and exits 0
when every check passed. World size 1 makes every reduction the identity, so the checks use
distinct values per tensor and per element: a fused message unpacked into the wrong place, a
missed stream ordering or a lost write changes the numbers.

Two modes. "backend": ``init_process_group("gradientflow")`` (torch >= 2.14). "engine": where
the Python ``Backend`` subclass cannot be constructed (torch < 2.14 says "GradientFlowBackend:
No constructor defined!"), the default group is torch's own ``cpu:gloo,cuda:nccl`` and the
layers under the backend run as the backend would wire them: ``Transports`` (the real
``ProcessGroupNCCL`` factory) and the ``Engine`` (fusion, rounds, eager path),
registered for the world group so the DDP hooks and the DistributedOptimizer use
them. Only the backend's thin validation layer is then left out.
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

# GF_WORLD1_DEVICE=cpu runs the same checks over gloo (a dry run of this script without a GPU).
DEV = torch.device(os.environ.get("GF_WORLD1_DEVICE", "cuda:0"))
CUDA = DEV.type == "cuda"


def sync():
    if CUDA:
        torch.cuda.synchronize()


def busy(cycles: int) -> None:
    """Keep the current CUDA stream busy (a race with another stream would then show)."""
    if CUDA:
        torch.cuda._sleep(cycles)
RESULTS: list[dict] = []
CHECKS: list = []
OUT: dict = {"path": None, "t0": time.perf_counter()}
# One check on one GPU takes seconds; past this its threads' stacks are dumped and we exit.
CHECK_TIMEOUT_S = float(os.environ.get("GF_WORLD1_CHECK_TIMEOUT_S", "90"))


def _write() -> None:
    """Write the records so far (after every check: a hang or a kill keeps what ran)."""
    if not OUT["path"]:
        return
    summary = {"mode": MODE["mode"], "torch": torch.__version__,
               "device": torch.cuda.get_device_name(DEV) if CUDA else "cpu",
               "seconds": round(time.perf_counter() - OUT["t0"], 1), "checks": RESULTS}
    with open(OUT["path"] + ".tmp", "w") as f:
        json.dump(summary, f, indent=1, default=str)
    os.replace(OUT["path"] + ".tmp", OUT["path"])


def check(fn):
    """Register a check (run in definition order by main)."""
    CHECKS.append(fn)
    return fn


def run_check(fn):
    """Run one check, recording it; a failure is recorded and the next check still runs."""
    import gradientflow

    t0 = time.perf_counter()
    # Recorded (and written) before it runs: a check that hangs shows as never finished, and
    # faulthandler then prints every thread's stack and ends the process (see main).
    rec = {"name": fn.__name__, "ok": False, "error": "did not finish (hung, or the process died)"}
    RESULTS.append(rec)
    _write()
    faulthandler.dump_traceback_later(CHECK_TIMEOUT_S, exit=True)
    ops0 = gradientflow.stats().get("operations", 0)
    try:
        details = fn()
        sync()
        rec["ok"] = True
        del rec["error"]
        if details is not None:
            rec["details"] = details
        # Operations our engine counted: shows the check went through it (hooks, optimizer).
        rec["engine_operations"] = gradientflow.stats().get("operations", 0) - ops0
    except BaseException as exc:  # noqa: BLE001 - recorded, reported, the run goes on
        rec["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        rec["traceback"] = traceback.format_exc()[-4000:]
    faulthandler.cancel_dump_traceback_later()
    rec["seconds"] = round(time.perf_counter() - t0, 3)
    _write()
    status = "PASS " if rec["ok"] else "FAIL "
    print(status + rec["name"] + ("" if rec["ok"] else ": " + rec["error"]), flush=True)


MODE = {"mode": None}
SHIM: dict = {}


class _EngineShim:
    """What GradientFlowBackend holds, built from the same parts (engine mode only)."""

    def __init__(self, store, timeout):
        from gradientflow.backend.transports import Transports
        from gradientflow.backend.transports import make_gloo as _make_gloo
        from gradientflow.config import Config
        from gradientflow.engine.engine import Engine

        self.transports = Transports(store, 0, 1, timeout)
        self._agree = _make_gloo(store, 0, 1, timeout, "gradientflow/agree/")
        self.engine = Engine(0, 1, Config.resolve({}), timeout.total_seconds(), self.transports.get,
                             self._agree, name="gpu-check")

    def allreduce(self, tensors, opts=None, priority=None):
        """The backend's allreduce as the optimizer calls it (backend.api.allreduce_async)."""
        from torch._C._distributed_c10d import AllreduceOptions

        t = tensors[0]
        opts = opts or AllreduceOptions()
        return self.engine.allreduce(tensors, opts, t, opts.reduceOp,
                                     t.numel() * t.element_size(), True, priority)

    def close(self):
        self.engine.close()
        self.transports.shutdown()


def all_reduce(t, op=dist.ReduceOp.SUM, async_op=False):
    """dist.all_reduce, or in engine mode the backend's own path (fused or eager) on the engine."""
    if MODE["mode"] == "backend":
        return dist.all_reduce(t, op=op, async_op=async_op)
    from torch._C._distributed_c10d import AllreduceOptions

    shim = SHIM["shim"]
    eng = shim.engine
    opts = AllreduceOptions()
    opts.reduceOp = op
    w = eng.allreduce([t], opts, t, opts.reduceOp, t.numel() * t.element_size(), async_op)
    if async_op:
        return w
    w.wait()
    return None


def eager(name, device, launch):
    """Engine mode: one collective in sequence order through the engine, waited on."""
    shim = SHIM["shim"]
    w = shim.engine.collective(name, device, launch, [])
    w.wait()


def pattern(n: int, salt: int) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float32, device=DEV) % 1009) * 0.5 + salt


def backend():
    if MODE["mode"] == "engine":
        return SHIM["shim"]
    from gradientflow.backend.registry import backend_of

    return backend_of()


@check
def init_and_nccl_transport():
    x = pattern(1 << 20, 3)
    y = x.clone()
    all_reduce(y)
    assert torch.equal(x, y)
    b = backend()
    created = b.transports.created()
    nccl = b.transports.get(DEV)
    name = type(nccl.group).__name__  # the process group under the dtype adapter
    if not CUDA:
        return {"transports": created, "transport": name}
    assert "cuda" in created, created
    assert "NCCL" in name, name
    return {"transports": created, "cuda_transport": name,
            "nccl_version": ".".join(map(str, torch.cuda.nccl.version()))}


@check
def all_reduce_sync_ops():
    out = {}
    for op, expect in ((dist.ReduceOp.SUM, 1.0), (dist.ReduceOp.AVG, 1.0), (dist.ReduceOp.MAX, 1.0),
                       (dist.ReduceOp.MIN, 1.0), (dist.ReduceOp.PRODUCT, 1.0)):
        x = pattern(300_001, 1)
        y = x.clone()
        all_reduce(y, op=op)
        assert torch.equal(y, x * expect), (op, (y - x).abs().max())
        out[str(op)] = "ok"
    for dtype in (torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64):
        x = pattern(4097, 2).to(dtype)
        y = x.clone()
        all_reduce(y)
        assert torch.equal(x, y), dtype
    # 4-byte synchronous allreduce: below the sync fusion limit, it takes the deferred path.
    t = torch.tensor([5.0], device=DEV)
    all_reduce(t)
    assert t.item() == 5.0
    return out


@check
def all_reduce_async_large_eager():
    x = pattern(8 << 20, 4)  # 32 MB > the 16 MB fusion threshold: eager, no copy
    y = x.clone()
    w = all_reduce(y, async_op=True)
    w.wait()
    assert torch.equal(x, y)
    fut = all_reduce(y, async_op=True).get_future()
    fut.wait()
    assert torch.equal(x, y)


@check
def all_reduce_async_small_fused():
    import gradientflow

    gradientflow.reset_stats()
    sizes = [1, 3, 17, 256, 1000, 4096, 65_537, 100_000] * 8
    xs = [pattern(n, i) for i, n in enumerate(sizes)]
    ys = [x.clone() for x in xs]
    works = [all_reduce(y, async_op=True) for y in ys]
    for w in works:
        w.wait()
    for i, (x, y) in enumerate(zip(xs, ys)):
        assert torch.equal(x, y), (i, sizes[i])
    # mixed dtypes in one batch (separate fusion queues) and a synchronous one closing it
    a = [pattern(1000, 7).half(), pattern(1000, 8), pattern(10, 9).double()]
    b = [t.clone() for t in a]
    ws = [all_reduce(t, async_op=True) for t in b]
    s = torch.tensor([2.0, 3.0], device=DEV)
    all_reduce(s)
    [w.wait() for w in ws]
    assert all(torch.equal(p, q) for p, q in zip(a, b)) and s.tolist() == [2.0, 3.0]
    st = gradientflow.stats()
    if not isinstance(st, dict):
        return str(st)
    return {k: v for k, v in st.items() if not isinstance(v, (dict, list))}


@check
def all_reduce_async_written_just_before():
    """Tensors produced by a kernel right before the async allreduce, read right after wait():
    stream ordering between the caller, the engine thread's copies and NCCL."""
    for rep in range(20):
        xs = [torch.empty(50_000 + 13 * i, device=DEV) for i in range(40)]
        for i, x in enumerate(xs):
            x.copy_(pattern(x.numel(), rep * 100 + i))
        works = [all_reduce(x, async_op=True) for x in xs]
        for w in works:
            w.wait()
        for i, x in enumerate(xs):
            expect = pattern(x.numel(), rep * 100 + i)
            assert torch.equal(x, expect), (rep, i)


@check
def all_reduce_on_a_side_stream():
    if not CUDA:
        return "cpu: no streams"
    """The caller works on a non-default stream (as AMP/DDP users do): results must still be
    the caller's values, ordered after the writes on that stream."""
    s = torch.cuda.Stream()
    bad = []
    with torch.cuda.stream(s):
        for rep in range(10):
            xs = [torch.empty(200_000, device=DEV) for _ in range(8)]
            busy(5_000_000)  # the side stream is busy when the collective is issued
            for i, x in enumerate(xs):
                x.copy_(pattern(x.numel(), rep * 10 + i))
            works = [all_reduce(x, async_op=True) for x in xs]
            big = torch.empty(8 << 20, device=DEV)
            busy(5_000_000)
            big.copy_(pattern(big.numel(), 77))
            all_reduce(big)
            for w in works:
                w.wait()
            for i, x in enumerate(xs):
                if not torch.equal(x, pattern(x.numel(), rep * 10 + i)):
                    bad.append(("small", rep, i))
            if not torch.equal(big, pattern(big.numel(), 77)):
                bad.append(("big", rep))
    s.synchronize()
    assert not bad, f"{len(bad)} tensors wrong, first {bad[:5]}"


@check
def stages_on_a_side_stream():
    if not CUDA:
        return "cpu: no streams"
    """A multi-stage op (a compressed bucket's path) submitted from a busy side stream: its
    stages must read the caller's values, and the caller, after wait(), the op's result."""

    def gen(x):
        y = yield x  # world size 1: every stage is the identity
        y.mul_(2)
        z = yield y
        return z + 1

    def submit(g):
        if MODE["mode"] == "engine":
            return SHIM["shim"].engine.stages("stages", g, DEV)
        from gradientflow.backend.api import submit_stages

        return submit_stages(None, "side-stream", g, DEV)

    s = torch.cuda.Stream()
    bad = []
    with torch.cuda.stream(s):
        for rep in range(10):
            x = torch.empty(1 << 20, device=DEV)
            busy(5_000_000)
            x.copy_(pattern(x.numel(), rep))
            out = submit(gen(x)).wait()
            if not torch.equal(out, pattern(x.numel(), rep) * 2 + 1):
                bad.append(rep)
    s.synchronize()
    assert not bad, f"reps with wrong results: {bad}"


@check
def broadcast_gather_scatter_family():
    if MODE["mode"] == "engine":
        return _family_on_engine()
    x = pattern(10_000, 5)
    y = x.clone()
    dist.broadcast(y, src=0)
    assert torch.equal(x, y)
    outs = [torch.empty_like(x)]
    dist.all_gather(outs, x)
    assert torch.equal(outs[0], x)
    big = torch.empty_like(x)
    dist.all_gather_into_tensor(big, x)
    assert torch.equal(big, x)
    r = torch.empty_like(x)
    dist.reduce_scatter(r, [x.clone()])
    assert torch.equal(r, x)
    r2 = torch.empty_like(x)
    dist.reduce_scatter_tensor(r2, x.clone())
    assert torch.equal(r2, x)
    z = x.clone()
    dist.reduce(z, dst=0)
    assert torch.equal(z, x)
    a2a = torch.empty_like(x)
    dist.all_to_all_single(a2a, x)
    assert torch.equal(a2a, x)
    obj = [None]
    dist.all_gather_object(obj, {"rank": 0})
    assert obj == [{"rank": 0}]
    dist.barrier()
    w = dist.all_gather_into_tensor(big, x, async_op=True)
    w.wait()
    assert torch.equal(big, x)
    if CUDA:
        dist.barrier(device_ids=[0])


def _family_on_engine():
    from torch._C._distributed_c10d import (
        AllgatherOptions,
        BarrierOptions,
        BroadcastOptions,
        ReduceScatterOptions,
    )

    x = pattern(10_000, 5)
    y = x.clone()
    b = BroadcastOptions()
    b.rootRank = 0
    eager("broadcast", DEV, lambda tp: tp.broadcast([y], b))
    assert torch.equal(x, y)
    outs = [torch.empty_like(x)]
    eager("all_gather", DEV, lambda tp: tp.allgather([outs], [x], AllgatherOptions()))
    assert torch.equal(outs[0], x)
    big = torch.empty_like(x)
    eager("all_gather_into_tensor", DEV, lambda tp: tp._allgather_base(big, x, AllgatherOptions()))
    assert torch.equal(big, x)
    r = torch.empty_like(x)
    eager("reduce_scatter", DEV,
          lambda tp: tp.reduce_scatter([r], [[x.clone()]], ReduceScatterOptions()))
    assert torch.equal(r, x)
    r2 = torch.empty_like(x)
    eager("reduce_scatter_tensor", DEV,
          lambda tp: tp._reduce_scatter_base(r2, x.clone(), ReduceScatterOptions()))
    assert torch.equal(r2, x)
    eager("barrier", torch.device("cpu"), lambda tp: tp.barrier(BarrierOptions()))
    # an eager op queued behind deferred ones (the engine thread launches it, not the caller)
    ws = [all_reduce(pattern(100, i), async_op=True) for i in range(10)]
    big2 = torch.empty_like(x)
    eager("all_gather_into_tensor", DEV, lambda tp: tp._allgather_base(big2, x, AllgatherOptions()))
    [w.wait() for w in ws]
    assert torch.equal(big2, x)
    return "engine mode: transport calls through Engine.collective"


@check
def cpu_and_cuda_in_one_program():
    c = torch.arange(1000, dtype=torch.float32)
    g = pattern(1000, 1)
    ws = [all_reduce(c, async_op=True), all_reduce(g, async_op=True),
          all_reduce(c * 0 + 1, async_op=True)]
    [w.wait() for w in ws]
    assert torch.equal(c, torch.arange(1000, dtype=torch.float32))
    assert torch.equal(g, pattern(1000, 1))
    return {"transports": backend().transports.created()}


# ------------------------------------------------------------------ DDP and the optimizer

def _cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1, stride=2), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(), torch.nn.Linear(512, 10)).to(DEV)


def _data(steps=6):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 3, 16, 16, generator=gen).to(DEV),
             torch.randint(0, 10, (32,), generator=gen).to(DEV)) for _ in range(steps)]


def _train(model, data, opt_factory=None, lr=0.1):
    opt = (opt_factory or (lambda m: torch.optim.SGD(m.parameters(), lr=lr)))(model)
    loss_fn = torch.nn.CrossEntropyLoss()
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _max_diff(a, b):
    return max(float((p - q).abs().max()) for p, q in zip(a, b))


REF = {}


def _reference():
    if "params" not in REF:
        REF["params"] = _train(_cnn(), _data())
    return REF["params"]


@check
def ddp_plain():
    from torch.nn.parallel import DistributedDataParallel as DDP

    got = _train(DDP(_cnn(), device_ids=[0] if CUDA else None, bucket_cap_mb=0.01), _data())
    d = _max_diff(got, _reference())
    assert d < 1e-4, d
    return {"max_abs_diff_vs_local": d}


def _on_side_stream(side: bool, fn):
    """fn() with a fresh, busy CUDA stream current (side=True), as AMP-style users train."""
    if not (side and CUDA):
        return fn()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        busy(5_000_000)
        out = fn()
    torch.cuda.current_stream().wait_stream(s)
    return out


def _ddp_hook(cfg, tol, side=False):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradientflow.hooks as hooks
    from gradientflow import kernels as K

    model = DDP(_cnn(), device_ids=[0] if CUDA else None, bucket_cap_mb=0.01)
    state = hooks.register(model, cfg)
    got = _on_side_stream(side, lambda: _train(model, _data()))
    d = _max_diff(got, _reference())
    st = state.stats()
    assert all(bool(torch.isfinite(p).all()) for p in got)
    if tol is not None:
        assert d < tol, d
    return {"max_abs_diff_vs_local": d, "numba_cuda_loaded": K._cuda() is not None,
            "numba_cuda_error": repr(K.cuda_error()), "steps": st.get("steps"),
            "ratio": (st["steady"].get("ratio") if isinstance(st.get("steady"), dict)
                      else None)}


@check
def ddp_fp16_hook():
    from gradientflow.compression import CompressionConfig

    return _ddp_hook(CompressionConfig(method="fp16"), 5e-3)


@check
def ddp_csc_hook_density_1():
    from gradientflow.compression import CompressionConfig

    # No momentum correction: the reference is plain SGD, and at density 1 the compressor's
    # momentum is kept (it would then be SGD with momentum).
    return _ddp_hook(CompressionConfig(method="csc", density=1.0, chunk_size=256,
                                       warmup_densities=(), min_numel=1,
                                       momentum_correction=False), 5e-3)


@check
def ddp_csc_hook_density_1_fp32_exact():
    from gradientflow.compression import CompressionConfig

    return _ddp_hook(CompressionConfig(method="csc", density=1.0, chunk_size=256, wire_dtype="fp32",
                                       dense_wire_dtype="fp32", warmup_densities=(), min_numel=1,
                                       momentum_correction=False), 1e-4)


@check
def ddp_hooks_on_a_side_stream():
    """The FP16 and the exact CSC hook (the engine's multi-stage path), trained on a side stream."""
    from gradientflow.compression import CompressionConfig

    return {"fp16": _ddp_hook(CompressionConfig(method="fp16"), 5e-3, side=True),
            "csc_fp32": _ddp_hook(CompressionConfig(method="csc", density=1.0, chunk_size=256,
                                                    wire_dtype="fp32", dense_wire_dtype="fp32",
                                                    warmup_densities=(), min_numel=1,
                                                    momentum_correction=False),
                                  1e-4, side=True)}


@check
def ddp_csc_hook_1_percent():
    from gradientflow.compression import CompressionConfig

    return _ddp_hook(CompressionConfig(method="csc", density=0.01, chunk_size=64,
                                       warmup_densities=(), min_numel=1), None)


@check
def ddp_csc_hook_momentum_correction():
    from gradientflow.compression import CompressionConfig

    return _ddp_hook(CompressionConfig(method="csc", density=0.05, chunk_size=64,
                                       warmup_densities=(), momentum_correction=True,
                                       min_numel=1), None)


def _dist_opt(compression, tol, side=False):
    import gradientflow

    def make(model):
        return gradientflow.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
            compression=compression, partition_bytes=16 << 10)

    got = _on_side_stream(side, lambda: _train(_cnn(), _data(), make))
    d = _max_diff(got, _reference())
    assert all(bool(torch.isfinite(p).all()) for p in got)
    if tol is not None:
        assert d < tol, d
    return {"max_abs_diff_vs_local": d}


@check
def distributed_optimizer_dense():
    return _dist_opt(None, 1e-4)


@check
def distributed_optimizer_fp16():
    return _dist_opt("fp16", 5e-3)


@check
def distributed_optimizer_csc():
    from gradientflow.compression import CompressionConfig

    return _dist_opt(CompressionConfig(method="csc", density=0.01, chunk_size=64,
                                       warmup_densities=(), min_numel=1), None)


@check
def distributed_optimizer_on_a_side_stream():
    """Dense and FP16 partitions issued into the engine during backward, on a side stream."""
    return {"dense": _dist_opt(None, 1e-4, side=True), "fp16": _dist_opt("fp16", 5e-3, side=True)}


@check
def distributed_optimizer_broadcast_parameters():
    import gradientflow

    model = _cnn()
    gradientflow.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, _data(1), lambda m: opt)
    gradientflow.broadcast_optimizer_state(opt, root_rank=0)


def _init_engine_mode() -> None:
    """torch < 2.14: torch's own group for DDP, our engine and transports registered for it."""
    import datetime

    from gradientflow.backend import registry

    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group("cpu:gloo,cuda:nccl" if CUDA else "gloo",
                            init_method=f"file://{tempfile.mktemp(prefix='gf-world1-pg-')}",
                            rank=0, world_size=1, timeout=timeout)
    store = dist.FileStore(tempfile.mktemp(prefix="gf-world1-store-"), 1)
    SHIM["shim"] = _EngineShim(store, timeout)
    registry.add(str(dist.group.WORLD.group_name), SHIM["shim"])
    MODE["mode"] = "engine"


def main() -> int:
    OUT["path"] = sys.argv[1] if len(sys.argv) > 1 else None
    import gradientflow  # noqa: F401 - registers the backend (torch < 2.14 reads no entry point)

    if CUDA:
        torch.cuda.set_device(DEV)
    init_file = tempfile.mktemp(prefix="gf-world1-")
    checks = list(CHECKS)
    only = os.environ.get("GF_WORLD1_ONLY")  # a comma-separated subset, for debugging
    if only:
        checks = [c for c in checks if c.__name__ in only.split(",")]
    try:
        if os.environ.get("GF_WORLD1_FORCE_ENGINE"):  # dry-run engine mode on a torch that has both
            raise TypeError("GradientFlowBackend: No constructor defined! (forced by "
                            "GF_WORLD1_FORCE_ENGINE)")
        dist.init_process_group("gradientflow", init_method=f"file://{init_file}", rank=0,
                                world_size=1)
        MODE["mode"] = "backend"
    except BaseException as exc:  # noqa: BLE001
        RESULTS.append({"name": "init_process_group(gradientflow)", "ok": False, "error": repr(exc),
                        "traceback": traceback.format_exc()[-4000:]})
        if "No constructor defined" not in str(exc) or os.environ.get("GF_WORLD1_NO_ENGINE_MODE"):
            checks = []
        else:
            _init_engine_mode()
    for fn in checks:
        run_check(fn)
    try:
        if "shim" in SHIM:
            SHIM["shim"].close()
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001
        RESULTS.append({"name": "destroy_process_group", "ok": False, "error": repr(exc)})
    _write()
    failed = [r["name"] for r in RESULTS if not r["ok"]]
    print(f"mode {MODE['mode']}: {len(RESULTS) - len(failed)} passed, {len(failed)} failed: "
          f"{failed}",
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
