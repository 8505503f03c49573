"""GPU check: the numba CUDA kernels, the NCCL transport and the CSC kernel timings on one GPU.

The one script to run on a machine with a CUDA device (nothing here runs in CI). Parts, each in
its own interpreter with a time limit, so one crash or hang does not lose the others:

- ``env``: torch / CUDA / NCCL / numba / numba-cuda versions, whether numba's CUDA target loads;
- ``pytest``: tests/gpu's kernel tests (numba CUDA vs the torch reference on CUDA tensors)
  and tests/kernels' dispatch and simulator tests;
- ``world1``: tests/gpu/_world1.py's per-check records (collectives, DDP + hooks, optimizer);
- ``two_ranks``: two ranks on the one GPU, over gradientflow and over plain nccl;
- ``kernels``: one CSC step on ResNet-50's 25,557,032-element gradient, chunk 1024, 1%,
  numba CUDA vs the torch reference on the GPU, per stage, timed with CUDA events (alternating
  rep by rep, medians), plus a device copy of the gradient as the bandwidth bound, and the
  bit-for-bit comparison of the two at that size.

    python benchmarks/gpu_check.py [--quick] [--out DIR] [--parts env,pytest,...]

Writes DIR/gpu_check.json, DIR/gpu_check.md and DIR/gpu_check_pytest.log.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("env", "kernels", "world1", "two_ranks", "pytest")
RESNET50_NUMEL = 25_557_032
CHUNK = 1024
DENSITY = 0.01


# ---------------------------------------------------------------------------------- parts


def part_env() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
            "torch_cuda": torch.version.cuda, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, sms=p.multi_processor_count,
                    mem_gib=round(p.total_memory / 2**30, 1),
                    capability=f"{p.major}.{p.minor}",
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
    from importlib import metadata

    for pkg in ("numba", "numba-cuda", "llvmlite", "numpy", "cuda-bindings", "cupy-cuda13x"):
        try:
            info[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            info[pkg] = None
    try:
        from numba import cuda

        info["numba_cuda_is_available"] = bool(cuda.is_available())
        from gradientflow import kernels as K

        info["dispatch_cuda_module"] = K._cuda() is not None
        info["dispatch_cuda_error"] = repr(K._cuda_error) if K._cuda_error else None
        info["fma_contraction"] = _fma_probe()
    except Exception as exc:  # noqa: BLE001
        info["numba_cuda_error"] = repr(exc)
    return info


def _fma_probe() -> dict:
    """How many of 1M results of ``a * b + c`` differ in bits from torch's (two kernels, two
    roundings): with numba's default NVVM options and with libdevice's fmul_rn."""
    import torch
    from numba import cuda
    from numba.cuda import libdevice

    from gradientflow.kernels import cuda as KC  # noqa: F401 - its numpy 2.5 shim first

    @cuda.jit
    def plain(a, b, c, out):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = a[i] * b[i] + c[i]

    @cuda.jit
    def rn(a, b, c, out):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = libdevice.fmul_rn(a[i], b[i]) + c[i]

    n = 1 << 20
    g = torch.Generator(device="cuda").manual_seed(0)
    a, b, c = (torch.randn(n, device="cuda", generator=g) for _ in range(3))
    ref = a * b + c
    res = {}
    for name, k in (("default", plain), ("fmul_rn", rn)):
        out = torch.empty_like(ref)
        args = [cuda.as_cuda_array(t) for t in (a, b, c, out)]
        k[(n + 255) // 256, 256](*args)
        cuda.synchronize()
        differ = out.view(torch.int32) != ref.view(torch.int32)
        res[name + "_bits_differ_of_1M"] = int(differ.sum())
    return res


def part_kernels(quick: bool) -> dict:
    import torch

    from gradientflow import kernels as K

    n = 1 << 20 if quick else RESNET50_NUMEL
    reps = 5 if quick else 30
    dev = torch.device("cuda", 0)
    nch = K.nchunks_of(n, CHUNK)
    k = max(1, int(nch * DENSITY))
    gen = torch.Generator(device=dev).manual_seed(0)
    grad0 = torch.randn(n, device=dev, generator=gen)
    res0 = torch.randn(n, device=dev, generator=gen) * 0.1
    out: dict = {"numel": n, "chunk": CHUNK, "k": k, "nchunks": nch, "reps": reps}

    # 1. Correctness at full size: the two implementations side by side.
    st = {}
    for impl in ("numba", "torch"):
        g, r = grad0.clone(), res0.clone()
        norms = K.chunk_norms(g, r, CHUNK, "l1", impl=impl)
        st[impl] = (g, r, norms)
    idx = K.select_chunks(st["torch"][2], k)
    packs = {}
    for impl in ("numba", "torch"):
        g, r, _ = st[impl]
        packed = K.pack_chunks(g, idx, CHUNK, 0.5, torch.float16, impl=impl)
        packs[impl] = packed.clone()
        K.unpack_update(g, r, packed, packed.clone(), idx, CHUNK, 1.0, 2.0, out=g, impl=impl)
    nn_, nt = st["numba"][2], st["torch"][2]

    def nbits_differ(a, b):
        view = torch.int16 if a.dtype in (torch.float16, torch.bfloat16) else torch.int32
        return int((a.view(view) != b.view(view)).sum())

    out["correctness"] = {
        "norms_max_rel_err": float(((nn_ - nt).abs() / nt.abs().clamp_min(1e-30)).max()),
        "same_selection_from_numba_norms": bool(torch.equal(K.select_chunks(nn_, k), idx)),
        "packed_fp16_bits_differ": nbits_differ(packs["numba"], packs["torch"]),
        "grad_out_bits_differ": nbits_differ(st["numba"][0], st["torch"][0]),
        "residual_bits_differ": nbits_differ(st["numba"][1], st["torch"][1]),
    }
    del st, packs

    # 2. Timing: per stage with CUDA events; variants alternate rep by rep.
    grad, res = grad0.clone(), res0.clone()
    send = torch.empty(k * CHUNK, dtype=torch.float16, device=dev)
    copy_dst = torch.empty_like(grad)
    stages = ("norms", "select", "pack", "unpack")
    times = {impl: {s: [] for s in (*stages, "total_events", "total_wall")}
             for impl in ("numba", "torch")}
    times["copy"] = {"copy": []}
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(5)]

    def step(impl):
        grad.copy_(grad0)
        res.copy_(res0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ev[0].record()
        norms = K.chunk_norms(grad, res, CHUNK, "l1", impl=impl)
        ev[1].record()
        idx = K.select_chunks(norms, k)
        ev[2].record()
        packed = K.pack_chunks(grad, idx, CHUNK, 0.5, torch.float16, out=send, impl=impl)
        local = packed.clone()
        ev[3].record()
        K.unpack_update(grad, res, packed, local, idx, CHUNK, 1.0, 2.0, out=grad, impl=impl)
        ev[4].record()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        for i, s in enumerate(stages):
            times[impl][s].append(ev[i].elapsed_time(ev[i + 1]))
        times[impl]["total_events"].append(ev[0].elapsed_time(ev[4]))
        times[impl]["total_wall"].append(wall * 1e3)

    def copy():
        torch.cuda.synchronize()
        ev[0].record()
        copy_dst.copy_(grad0)
        ev[1].record()
        torch.cuda.synchronize()
        times["copy"]["copy"].append(ev[0].elapsed_time(ev[1]))

    for _ in range(3):  # warm-up: numba compiles on first launch
        step("numba"), step("torch"), copy()
    for v in times.values():
        for lst in v.values():
            lst.clear()
    for _ in range(reps):
        step("numba"), step("torch"), copy()

    def med(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])

    out["median_ms"] = {impl: {s: round(med(v), 4) for s, v in d.items()}
                        for impl, d in times.items()}
    copy_ms = out["median_ms"]["copy"]["copy"]
    out["copy_GBps"] = round(8 * n / (copy_ms * 1e-3) / 1e9, 1)
    # The fused pipeline must move 24 bytes per element at the least (see bench_kernels.py).
    for impl in ("numba", "torch"):
        t = out["median_ms"][impl]["total_events"]
        out["median_ms"][impl]["pipeline_GBps"] = round(24 * n / (t * 1e-3) / 1e9, 1)
    # Dense FP16 path for reference.
    half = torch.empty(n, dtype=torch.float16, device=dev)
    back = torch.empty(n, device=dev)
    dense = {"numba": [], "torch": []}
    for rep in range(reps + 3):
        for impl in ("numba", "torch"):
            torch.cuda.synchronize()
            ev[0].record()
            K.cast_scaled(grad0, 0.5, torch.float16, out=half, impl=impl)
            K.upcast_scaled(half, 2.0, out=back, impl=impl)
            ev[1].record()
            torch.cuda.synchronize()
            if rep >= 3:
                dense[impl].append(ev[0].elapsed_time(ev[1]))
    out["dense_fp16_roundtrip_ms"] = {impl: round(med(v), 4) for impl, v in dense.items()}
    return out


# ---------------------------------------------------------------------------------- driver


def _run(cmd: list[str], timeout: int, env: dict | None = None) -> dict:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                           env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        return {"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr,
                "seconds": round(time.perf_counter() - t0, 1)}
    except subprocess.TimeoutExpired as exc:
        def text(x):
            return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")

        return {"rc": "timeout", "stdout": text(exc.stdout), "stderr": text(exc.stderr),
                "seconds": round(time.perf_counter() - t0, 1)}


def _inner(part: str, quick: bool) -> dict:
    """Run one in-process part in a child interpreter; its JSON comes back on a file."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    r = _run([sys.executable, __file__, "--inner", part, "--inner-out", path]
             + (["--quick"] if quick else []), timeout=400)
    try:
        data = json.loads(Path(path).read_text())
    except Exception:  # noqa: BLE001
        data = None
    return {"result": data, "rc": r["rc"], "seconds": r["seconds"],
            "log_tail": (r["stdout"] + r["stderr"])[-6000:]}


def _markdown(rep: dict) -> str:
    env = rep.get("env", {}).get("result") or {}
    lines = ["## GPU check", "",
             f"Device: {env.get('device')} ({env.get('sms')} SMs, {env.get('mem_gib')} GiB), torch "
             f"{env.get('torch')} (CUDA {env.get('torch_cuda')}), NCCL {env.get('nccl')}, numba "
             f"{env.get('numba')}, numba-cuda {env.get('numba-cuda')}; numba CUDA target loads: "
             f"{env.get('dispatch_cuda_module')} {env.get('dispatch_cuda_error') or ''}.", "",
             f"Command: `{rep['command']}`; written {rep['written']}.", ""]
    kern = (rep.get("kernels") or {}).get("result")
    if kern:
        m = kern["median_ms"]
        lines += [f"### CSC kernels, {kern['numel']:,} elements, chunk {kern['chunk']}, "
                  f"k = {kern['k']} of {kern['nchunks']} chunks, FP16 wire (medians of "
                  f"{kern['reps']} reps, CUDA events)", "",
                  "| stage | numba CUDA ms | torch ms | torch / numba |", "|---|---:|---:|---:|"]
        for s in ("norms", "select", "pack", "unpack", "total_events", "total_wall"):
            a, b = m["numba"][s], m["torch"][s]
            row = f"| {s} | {a:.3f} | {b:.3f} | {b / a:.2f}x |" if a else f"| {s} | {a} | {b} | |"
            lines.append(row)
        lines += ["", "Copy of the gradient (read + write 8 B/element): "
                  f"{m['copy']['copy']:.3f} ms = "
                  f"{kern['copy_GBps']} GB/s. Pipeline at 24 B/element: numba "
                  f"{m['numba']['pipeline_GBps']} GB/s, torch {m['torch']['pipeline_GBps']} GB/s. "
                  f"Dense FP16 cast + upcast: numba {kern['dense_fp16_roundtrip_ms']['numba']} ms, "
                  f"torch {kern['dense_fp16_roundtrip_ms']['torch']} ms.", "",
                  f"Full-size agreement: {kern['correctness']}.", ""]
    elif "kernels" in rep:
        lines += ["### CSC kernels: FAILED", "", "```", rep["kernels"]["log_tail"][-2000:],
                  "```", ""]
    w1 = (rep.get("world1") or {}).get("result")
    if w1:
        lines += ["### Backend on NCCL, world size 1", "", "| check | ok | s | details / error |",
                  "|---|---|---:|---|"]
        for c in w1["checks"]:
            det = c.get("error") or json.dumps(c.get("details", ""), default=str)
            lines.append(f"| {c['name']} | {'yes' if c['ok'] else '**NO**'} | "
                         f"{c.get('seconds', '')} | "
                         f"{det[:300].replace('|', '/')} |")
        lines.append("")
    elif "world1" in rep:
        lines += ["### Backend on NCCL, world size 1: no result", "", "```",
                  rep["world1"]["log_tail"][-2000:], "```", ""]
    for be, tr in (rep.get("two_ranks") or {}).items():
        res = tr.get("result")
        lines += [f"### Two ranks on one GPU over {be}", ""]
        if res:
            for r in res["ranks"]:
                lines.append(f"- rank {r['rank']}: ok={r.get('ok')} cpu={r.get('cpu_allreduce')} "
                             f"cuda={r.get('cuda_allreduce_first')} "
                             f"error={(r.get('error') or '')[:400]}")
            lines.append(f"- hung ranks: {res['hung_ranks']}")
        else:
            lines += ["```", tr["log_tail"][-1500:], "```"]
        lines.append("")
    pt = rep.get("pytest")
    if pt:
        tail = [ln for ln in (pt.get("stdout") or "").splitlines() if ln.strip()][-1:]
        lines += ["### pytest (tests/gpu kernels, tests/kernels dispatch + simulator)", "",
                  f"rc={pt['rc']}, {pt['seconds']} s: "
                  f"{tail[0] if tail else ''}", ""]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 M elements and 5 reps for the timings")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_check"),
                    help="folder for gpu_check.json/.md")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    ap.add_argument("--inner", help=argparse.SUPPRESS)
    ap.add_argument("--inner-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.inner:
        data = part_env() if args.inner == "env" else part_kernels(args.quick)
        Path(args.inner_out).write_text(json.dumps(data, indent=1, default=str))
        print(json.dumps(data, default=str)[:4000])
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [os.path.relpath(__file__, ROOT), *(argv or sys.argv[1:])]
    rep: dict = {"command": "python " + " ".join(cmd),
                 "written": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    parts = args.parts.split(",")
    for part in parts:
        t0 = time.perf_counter()
        print(f"== {part}", flush=True)
        if part in ("env", "kernels"):
            rep[part] = _inner(part, args.quick)
            print(json.dumps(rep[part]["result"], default=str)[:3000] if rep[part]["result"]
                  else rep[part]["log_tail"][-3000:], flush=True)
        elif part == "world1":
            path = out / "gpu_check_world1.json"
            r = _run([sys.executable, "tests/gpu/_world1.py", str(path)], timeout=400,
                     env={"GF_WORLD1_DEVICE": "cuda:0"})
            rep[part] = {"rc": r["rc"], "seconds": r["seconds"],
                         "log_tail": (r["stdout"] + r["stderr"])[-6000:],
                         "result": json.loads(path.read_text()) if path.exists() else None}
            print(r["stdout"][-3000:], r["stderr"][-2000:], flush=True)
        elif part == "two_ranks":
            rep[part] = {}
            for be in ("gradientflow", "cpu:gloo,cuda:nccl", "transport"):
                with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                    path = Path(f.name)
                r = _run([sys.executable, "tests/gpu/_two_ranks.py", be, str(path)], timeout=120)
                rep[part][be] = {"rc": r["rc"], "log_tail": (r["stdout"] + r["stderr"])[-4000:],
                                 "result": (json.loads(path.read_text())
                                            if path.stat().st_size else None)}
                print(be, r["stdout"][-2000:], r["stderr"][-1500:], flush=True)
        elif part == "pytest":
            # test_nccl.py runs _world1.py again (the world1 part above already did); the CPU
            # kernel tests need no GPU. Both are left out here to save device time.
            r = _run([sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider",
                      "tests/gpu", "--deselect",
                      "tests/gpu/test_nccl.py::test_backend_world1_on_cuda",
                      "tests/kernels/test_cuda_sim.py", "tests/kernels/test_dispatch.py"],
                     timeout=400)
            (out / "gpu_check_pytest.log").write_text(r["stdout"] + "\n" + r["stderr"])
            rep[part] = {"rc": r["rc"], "seconds": r["seconds"], "stdout": r["stdout"][-8000:]}
            print(r["stdout"][-4000:], flush=True)
        print(f"   ({time.perf_counter() - t0:.1f} s)", flush=True)
        # Written after every part: a run stopped at its time limit keeps what it measured.
        (out / "gpu_check.json").write_text(json.dumps(rep, indent=1, default=str) + "\n")
        md = _markdown(rep)
        (out / "gpu_check.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
