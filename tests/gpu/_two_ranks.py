"""Two ranks on one GPU over gradientflow, CUDA tensors on gloo (run by gpu_check; not a test).

``python _two_ranks.py RESULT.json`` starts 2 processes that both use cuda:0 and initialise
``init_process_group("gradientflow")`` with ``GRADIENTFLOW_CUDA_TRANSPORT=gloo`` (NCCL refuses
two ranks on one device). Each rank runs every check below in order and records it (name, ok,
seconds, error, details); the parent writes both ranks' records. The checks: every collective
on CUDA tensors with exact expected values, DDP with the CSC hook and the DistributedOptimizer
(dense and CSC) training a small CNN with parameters identical on both ranks, and the
parameter and optimizer-state broadcasts.

``GF_TWO_DEVICE=cpu`` runs the same checks on CPU tensors (a dry run without a GPU).
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

WORLD = 2
DEADLINE_S = float(os.environ.get("GF_TWO_DEADLINE_S", "240"))


def _dev() -> torch.device:
    return torch.device(os.environ.get("GF_TWO_DEVICE", "cuda:0"))


# ------------------------------------------------------------------ checks (run on every rank)

def _values(n, rank, dtype, dev):
    """Distinct per rank and per element, exact in every dtype below (small integers)."""
    return ((torch.arange(n) % 7) + 3 * rank + 1).to(dtype).to(dev)


def check_collectives(rank, dev):
    """Every collective DDP, FSDP and users call, with exact expected values."""
    import torch.distributed as dist

    R = dist.ReduceOp
    done = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32,
                  torch.int64):
        ops = [(R.SUM, lambda a, b: a + b), (R.MAX, torch.maximum), (R.MIN, torch.minimum),
               (R.PRODUCT, lambda a, b: a * b)]
        if dtype.is_floating_point:
            ops.append((R.AVG, lambda a, b: (a + b) / 2))
        for op, ref in ops:
            t = _values(1000, rank, dtype, dev)
            dist.all_reduce(t, op=op)
            want = ref(_values(1000, 0, dtype, dev), _values(1000, 1, dtype, dev))
            assert torch.equal(t, want.to(dtype)), (dtype, op)
        done[str(dtype)] = "all_reduce sum/max/min/product" + ("/avg" if dtype.is_floating_point
                                                               else "")
    # many small asynchronous all_reduces (fused by the engine) and one large (alone)
    ts = [_values(17 * i + 1, rank, torch.float32, dev) for i in range(40)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    big = _values(8 << 20, rank, torch.float32, dev)
    wbig = dist.all_reduce(big, async_op=True)
    for w in works + [wbig]:
        w.wait()
    for i, t in enumerate(ts):
        assert torch.equal(t, _values(17 * i + 1, 0, torch.float32, dev)
                           + _values(17 * i + 1, 1, torch.float32, dev)), i
    assert torch.equal(big, _values(8 << 20, 0, torch.float32, dev)
                       + _values(8 << 20, 1, torch.float32, dev))
    done["fused_async"] = "40 small + one 32 MB"
    b = _values(1000, rank, torch.float32, dev)
    dist.broadcast(b, src=1)
    assert torch.equal(b, _values(1000, 1, torch.float32, dev))
    x = _values(500, rank, torch.float32, dev)
    outs = [torch.empty_like(x) for _ in range(WORLD)]
    dist.all_gather(outs, x)
    assert all(torch.equal(o, _values(500, r, torch.float32, dev)) for r, o in enumerate(outs))
    flat = torch.empty(1000, device=dev)
    dist.all_gather_into_tensor(flat, x)
    assert torch.equal(flat, torch.cat([_values(500, r, torch.float32, dev) for r in range(2)]))
    rs_in = _values(1000, rank, torch.float32, dev)
    rs_out = torch.empty(500, device=dev)
    dist.reduce_scatter_tensor(rs_out, rs_in)
    want = (_values(1000, 0, torch.float32, dev) + _values(1000, 1, torch.float32, dev))
    assert torch.equal(rs_out, want[rank * 500:(rank + 1) * 500])
    a2a_in = _values(8, rank, torch.float32, dev)
    a2a_out = torch.empty(8, device=dev)
    dist.all_to_all_single(a2a_out, a2a_in)
    want = torch.cat([_values(8, r, torch.float32, dev)[rank * 4:(rank + 1) * 4]
                      for r in range(2)])
    assert torch.equal(a2a_out, want)
    dist.barrier()
    done["movement"] = ("broadcast, all_gather, all_gather_into_tensor, reduce_scatter_tensor, "
                        "all_to_all_single, barrier")
    return done


def _cnn(dev):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1, stride=2), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(), torch.nn.Linear(512, 10)).to(dev)


def _data(rank, dev, steps=6):
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    return [(torch.randn(32, 3, 16, 16, generator=gen).to(dev),
             torch.randint(0, 10, (32,), generator=gen).to(dev)) for _ in range(steps)]


def _train(model, opt, data):
    loss_fn = torch.nn.CrossEntropyLoss()
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _same_on_every_rank(flat):
    """The largest difference between this rank's vector and every rank's (0: identical)."""
    import torch.distributed as dist

    got = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(got, flat)
    assert all(bool(torch.isfinite(g).all()) for g in got)
    return max(float((g - flat).abs().max()) for g in got)


def _ddp(dev):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(_cnn(dev), device_ids=[dev.index] if dev.type == "cuda" else None,
               bucket_cap_mb=0.01)


def _ddp_reference(rank, dev):
    """DDP with no hook over the same backend: the dense average each step, plain SGD."""
    if "ddp" not in _REF:
        model = _ddp(dev)
        _REF["ddp"] = _train(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             _data(rank, dev))
    return _REF["ddp"]


_REF: dict = {}


def check_ddp_csc_hook(rank, dev):
    """CSC 5% with the default recipe (momentum correction): identical parameters."""
    import gradientflow
    from gradientflow.compression import CompressionConfig

    model = _ddp(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = gradientflow.hooks.register(
        model, CompressionConfig(method="csc", density=0.05, chunk_size=64,
                                 warmup_densities=(), min_numel=1), optimizer=opt)
    flat = _train(model, opt, _data(rank, dev))
    spread = _same_on_every_rank(flat)
    assert spread == 0.0, spread
    st = state.stats()
    return {"max_diff_between_ranks": spread, "steps": st.get("steps")}


def check_ddp_csc_density_1_is_dense(rank, dev):
    """CSC at density 1 on an FP32 wire is the dense average: DDP without a hook's parameters."""
    import gradientflow
    from gradientflow.compression import CompressionConfig

    model = _ddp(dev)
    gradientflow.hooks.register(
        model, CompressionConfig(method="csc", density=1.0, chunk_size=256, wire_dtype="fp32",
                                 dense_wire_dtype="fp32", warmup_densities=(), min_numel=1,
                                 momentum_correction=False))
    flat = _train(model, torch.optim.SGD(model.parameters(), lr=0.1), _data(rank, dev))
    d = float((flat - _ddp_reference(rank, dev)).abs().max())
    # The two trainings' own kernels differ run to run on a GPU (cuDNN's backward sums in
    # any order), by 3e-5 after 6 steps on an H200: not the transport's doing.
    assert d < (1e-4 if dev.type == "cuda" else 1e-5), d
    spread = _same_on_every_rank(flat)
    assert spread == 0.0, spread
    return {"max_diff_vs_ddp": d}


def _dist_opt(rank, dev, compression):
    import gradientflow

    model = _cnn(dev)
    opt = gradientflow.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
        compression=compression, partition_bytes=16 << 10)
    return _train(model, opt, _data(rank, dev))


def check_distributed_optimizer_dense(rank, dev):
    flat = _dist_opt(rank, dev, None)
    d = float((flat - _ddp_reference(rank, dev)).abs().max())
    assert d < (1e-4 if dev.type == "cuda" else 1e-5), d
    return {"max_diff_vs_ddp": d, "max_diff_between_ranks": _same_on_every_rank(flat)}


def check_distributed_optimizer_csc(rank, dev):
    from gradientflow.compression import CompressionConfig

    flat = _dist_opt(rank, dev, CompressionConfig(method="csc", density=0.05, chunk_size=64,
                                                  warmup_densities=(), min_numel=1,
                                                  momentum_correction=False))
    spread = _same_on_every_rank(flat)
    assert spread == 0.0, spread
    return {"max_diff_between_ranks": spread}


def check_broadcasts(rank, dev):
    """broadcast_parameters and broadcast_optimizer_state make rank-dependent state rank 0's."""
    import gradientflow

    model = _cnn(dev)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt, _data(rank, dev, steps=1))
    gradientflow.broadcast_parameters(model.state_dict(), root_rank=0)
    gradientflow.broadcast_optimizer_state(opt, root_rank=0)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    bufs = torch.cat([opt.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters()])
    assert _same_on_every_rank(flat) == 0.0 and _same_on_every_rank(bufs) == 0.0
    return {}


CHECKS = [check_collectives, check_ddp_csc_hook, check_ddp_csc_density_1_is_dense,
          check_distributed_optimizer_dense, check_distributed_optimizer_csc, check_broadcasts]


# ------------------------------------------------------------------ driver

def worker(rank, init_file, out_dir):
    os.environ["GRADIENTFLOW_CUDA_TRANSPORT"] = "gloo"
    import torch.distributed as dist

    import gradientflow  # noqa: F401 - registers the backend (torch < 2.14 needs the import)

    dev = _dev()
    records = []
    path = os.path.join(out_dir, f"rank{rank}.json")

    def write():
        with open(path + ".tmp", "w") as f:
            json.dump(records, f, default=str)
        os.replace(path + ".tmp", path)

    try:
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group("gradientflow", init_method=f"file://{init_file}", rank=rank,
                                world_size=WORLD, timeout=datetime.timedelta(seconds=60))
        for fn in CHECKS:
            rec = {"name": fn.__name__, "ok": False, "error": "did not finish"}
            records.append(rec)
            write()
            t0 = time.perf_counter()
            try:
                rec["details"] = fn(rank, dev)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                rec["ok"] = True
                del rec["error"]
            except BaseException as exc:  # noqa: BLE001 - recorded; the next check runs
                rec["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                rec["traceback"] = traceback.format_exc()[-3000:]
            rec["seconds"] = round(time.perf_counter() - t0, 2)
            write()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001
        records.append({"name": "init_process_group", "ok": False,
                        "error": f"{type(exc).__name__}: {exc}"[:2000],
                        "traceback": traceback.format_exc()[-3000:]})
    write()
    os._exit(0)  # skip the interpreter's teardown of CUDA and process-group state


def main() -> int:
    out = sys.argv[1]
    out_dir = tempfile.mkdtemp()
    init_file = tempfile.mktemp(prefix="gf-two-")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, init_file, out_dir)) for r in range(WORLD)]
    t0 = time.time()
    [p.start() for p in procs]
    for p in procs:
        p.join(max(1.0, t0 + DEADLINE_S - time.time()))
    hung = [i for i, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    ranks = []
    for r in range(WORLD):
        path = os.path.join(out_dir, f"rank{r}.json")
        ranks.append(json.load(open(path)) if os.path.exists(path)
                     else [{"name": "start", "ok": False, "error": "no result (hung or died)"}])
    names = [c.__name__ for c in CHECKS]
    ok = not hung and all(any(rec["name"] == n and rec["ok"] for rec in recs)
                          for recs in ranks for n in names)
    result = {"device": str(_dev()), "transport": "gloo", "hung_ranks": hung, "ok": ok,
              "seconds": round(time.time() - t0, 1), "ranks": ranks}
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    for n in names:
        states = [next((rec for rec in recs if rec["name"] == n), None) for recs in ranks]
        line = " ".join("ok" if s and s["ok"] else f"FAIL({(s or {}).get('error', 'missing')})"
                        for s in states)
        print(f"{n}: {line}", flush=True)
    print(f"two ranks over gradientflow (CUDA on gloo): {'all passed' if ok else 'FAILED'}, "
          f"{result['seconds']} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
