"""GPU acceptance check: the backend on CUDA tensors, the CSC kernels' speed, a DDP step's cost.

The one command to run on a machine with a CUDA device (``make gpu-check``; nothing here runs in
CI). It runs with whatever python3, torch, Triton and numba the machine has, from a plain
checkout (no install needed), and exits at once with a clear message where torch sees no GPU.
Parts, each in its own interpreter with a time limit, so a crash or a hang loses only itself:

- ``env``: torch / CUDA / NCCL / Triton / numba versions, which CUDA kernels the dispatch uses;
- ``kernels``: one CSC step on ResNet-50's 25,557,032-element gradient (chunk 1024, 1%, FP16
  wire) with each implementation (Triton, Triton replayed as one CUDA graph, numba CUDA, the
  torch reference), stage by stage, with the bytes each stage must move and the bandwidth it
  achieved against a device copy's, and the implementations' results compared at that size;
- ``ddp``: a DDP training step of torchvision's ResNet-50 on the GPU, over gradientflow (world
  size 1, NCCL), with no hook, the FP16 hook and the CSC hook, alternating step by step;
- ``world1``: tests/gpu/_world1.py, the backend over NCCL with world size 1 (collectives, DDP
  with every hook, the DistributedOptimizer, broadcasts, streams);
- ``two_ranks``: tests/gpu/_two_ranks.py, two ranks on the one GPU over gradientflow with CUDA
  tensors on gloo (NCCL refuses two ranks on one device): exact collectives, the CSC hook and
  the DistributedOptimizer training with identical parameters on both ranks;
- ``pytest``: tests/gpu (the CUDA kernels against the reference, compiled Triton and numba).

    python benchmarks/gpu_check.py [--quick] [--out DIR] [--parts env,kernels,...]
                                   [--budget-s 450]

Writes DIR/gpu_check.md (what ran, what passed, the timings) and DIR/gpu_check.json (all the
numbers), after every part: a run stopped at its limit keeps what it measured.
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
PARTS = ("env", "kernels", "ddp", "world1", "two_ranks", "pytest")
# Seconds each part may take at most (the whole run is also held to --budget-s).
PART_LIMIT_S = {"env": 60, "kernels": 180, "ddp": 150, "world1": 150, "two_ranks": 150,
                "pytest": 240}
RESNET50_NUMEL = 25_557_032
CHUNK = 1024
DENSITY = 0.01


# ---------------------------------------------------------------------------------- import path


def importable_checkout() -> None:
    """Make ``gradientflow`` importable from this checkout where it is not installed from it.

    The package is ``gradientflow/`` plus ``kernels/`` as ``gradientflow.kernels`` (the
    pyproject's package-dir). A folder of links gives that layout without an install; its path
    goes first on sys.path and on PYTHONPATH, which the parts' interpreters inherit.
    """
    site = os.environ.get("GF_CHECKOUT_SITE")
    if not site:
        try:
            import gradientflow.kernels as K

            if Path(K.__file__).resolve().is_relative_to(ROOT):
                return
        except ImportError:
            pass
        for name in [m for m in sys.modules if m == "gradientflow" or
                     m.startswith("gradientflow.")]:
            del sys.modules[name]  # another copy, installed elsewhere
        site = tempfile.mkdtemp(prefix="gf-checkout-")
        pkg = Path(site) / "gradientflow"
        pkg.mkdir()
        for entry in (ROOT / "gradientflow").iterdir():
            (pkg / entry.name).symlink_to(entry)
        (pkg / "kernels").symlink_to(ROOT / "kernels")
        os.environ["GF_CHECKOUT_SITE"] = site
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (site, str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    sys.path[:0] = [site, str(ROOT)]


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

    for pkg in ("triton", "numba", "numba-cuda", "numpy", "cupy-cuda13x", "torchvision"):
        try:
            info[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            info[pkg] = None
    from gradientflow import kernels as K
    from gradientflow.backend.backend import BACKEND_BASE

    info["backend_base"] = BACKEND_BASE.__name__
    info["triton_kernels"] = K._triton() is not None
    info["triton_error"] = repr(K.triton_error()) if K.triton_error() else None
    info["numba_cuda_kernels"] = K._cuda() is not None
    info["numba_cuda_error"] = repr(K.cuda_error()) if K.cuda_error() else None
    dev = torch.device("cuda")
    info["dispatch_on_cuda"] = {op: K.implementation(op, "auto", dev).__module__.rsplit(".", 1)[-1]
                                for op in K.OPS}
    return info


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else 0.5 * (xs[mid - 1] + xs[mid])


def _bits_differ(a, b) -> int:
    import torch

    view = torch.int16 if a.dtype in (torch.float16, torch.bfloat16) else torch.int32
    same = (a.view(view) == b.view(view)) | (torch.isnan(a.float()) & torch.isnan(b.float()))
    return int((~same).sum())


def part_kernels(quick: bool) -> dict:
    """One CSC step per implementation, per stage, timed with CUDA events; compared at size."""
    import torch

    from gradientflow import kernels as K

    n = 1 << 20 if quick else RESNET50_NUMEL
    reps = 5 if quick else 30
    dev = torch.device("cuda", 0)
    nch = K.nchunks_of(n, CHUNK)
    k = max(1, int(nch * DENSITY))
    half = torch.float16
    # "graph": the Triton pipeline as one CUDA graph per layout (kernels.StepGraphs), timed
    # as a whole step (its stages are one replay).
    impls = [i for i in ("triton", "graph", "numba", "torch")
             if not (i in ("triton", "graph") and K._triton() is None)
             and not (i == "numba" and K._cuda() is None)]
    gen = torch.Generator(device=dev).manual_seed(0)
    grad0 = torch.randn(n, device=dev, generator=gen)
    res0 = torch.randn(n, device=dev, generator=gen) * 0.1
    mom0 = torch.randn(n, device=dev, generator=gen) * 0.1
    out: dict = {"numel": n, "chunk": CHUNK, "k": k, "nchunks": nch, "reps": reps,
                 "impls": impls, "wire": "float16"}
    g, r, spare = torch.empty_like(grad0), torch.empty_like(grad0), torch.empty_like(grad0)
    mom, mom_out = torch.empty_like(grad0), torch.empty_like(grad0)
    send = torch.empty(k * CHUNK, dtype=half, device=dev)

    # The pipelines, as the compressor runs them ("ef": error feedback, v in the spare
    # buffer, only the sent chunks written back; "ef_momentum": the same with DGC momentum
    # correction, the default recipe) and the one-pass alternative ("inplace").
    def step(name, impl):
        inplace = name == "inplace"
        kw = dict(momentum=mom, momentum_out=mom_out, m=0.9) if name == "ef_momentum" else {}
        v = g if inplace else spare
        norms = K.chunk_norms(g, r, CHUNK, "l1", v_out=None if inplace else spare,
                              zero_grad=not inplace, impl=impl, **kw)
        yield "norms"
        idx = K.select_chunks(norms, k, impl=impl)
        yield "select"
        packed = K.pack_chunks(v, idx, CHUNK, 0.5, half, out=send, impl=impl)
        local = packed.clone()
        yield "pack"
        if inplace:
            K.unpack_update(g, r, packed, local, idx, CHUNK, 1.0, 2.0, out=g, impl=impl)
        else:
            K.unpack_sent(g, spare, packed, local, idx, CHUNK, 2.0, 2.0, impl=impl)
        yield "unpack"
        out_state["idx"], out_state["packed"], out_state["norms"] = idx, packed, norms

    pipelines = ("ef", "ef_momentum", "inplace")
    out_state: dict = {}

    def whole(name, *buffers):
        """The Triton step at once; the buffers it uses are passed so that they key its graph."""
        for _ in step(name, "triton"):
            pass
        return out_state["norms"], out_state["idx"], out_state["packed"]

    graphed = K.StepGraphs(whole)

    def run(name, impl):
        if impl == "graph":
            # a replay runs no Python: its results are the graph's own tensors
            result = graphed(name, g, r, spare, mom, mom_out, send)
            out_state["norms"], out_state["idx"], out_state["packed"] = result
        else:
            for _ in step(name, impl):
                pass
    # Fewest bytes each stage must move (each input read once, each output written once);
    # kc = the k sent chunks' elements.
    kc = k * CHUNK
    small = {"select": 16 * nch, "pack": 6 * kc + 4 * kc}
    bytes_min = {
        "ef": {"norms": 16 * n, **small, "unpack": 16 * kc},
        "ef_momentum": {"norms": 24 * n, **small, "unpack": 16 * kc},
        "inplace": {"norms": 12 * n, **small, "unpack": 12 * n + 4 * kc},
    }

    def reset(other=False):
        """The step's inputs (other: different contents in the same buffers)."""
        g.copy_(res0 if other else grad0)
        r.copy_(grad0 if other else res0)
        mom.copy_(-mom0 if other else mom0)

    # 1. Results compared at full size, each pipeline against the torch reference.
    compare = {}
    for name in pipelines:
        got = {}
        for impl in impls:
            if impl == "graph":
                # warmed and captured on other contents: the replay must read the new ones
                for _ in range(2):
                    reset(other=True)
                    run(name, impl)
            reset()
            run(name, impl)
            got[impl] = {"grad": g.clone(), "residual": (spare if name != "inplace" else r).clone(),
                         "momentum": mom_out.clone(), **{key: v.clone()
                                                         for key, v in out_state.items()}}
        ref = got["torch"]
        for impl in impls:
            if impl == "torch":
                continue
            mine = got[impl]
            rel = ((mine["norms"] - ref["norms"]).abs()
                   / ref["norms"].abs().clamp_min(1e-30)).max()
            compare[f"{name}/{impl}"] = {
                "norms_max_rel_err": float(rel),
                "same_selection": bool(torch.equal(mine["idx"], ref["idx"])),
                "packed_bits_differ": _bits_differ(mine["packed"], ref["packed"]),
                "grad_bits_differ": _bits_differ(mine["grad"], ref["grad"]),
                "residual_bits_differ": _bits_differ(mine["residual"], ref["residual"]),
                **({"momentum_bits_differ": _bits_differ(mine["momentum"], ref["momentum"])}
                   if name == "ef_momentum" else {}),
            }
        del got
    out["compare"] = compare

    # 2. Timing: per stage with CUDA events (host launch gaps count), variants alternating
    # rep by rep, medians; the inputs restored before each step.
    stages = ("norms", "select", "pack", "unpack")
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(stages) + 1)]
    times = {(p, i): {s: [] for s in (*stages, "step", "wall")} for p in pipelines
             for i in impls}
    copy_ms: list[float] = []
    copy_dst = torch.empty_like(grad0)

    def timed(name, impl):
        reset()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ev[0].record()
        if impl == "graph":
            run(name, impl)
            ev[-1].record()
        else:
            for j, _ in enumerate(step(name, impl)):
                ev[j + 1].record()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
        rec = times[(name, impl)]
        if impl != "graph":
            for j, s in enumerate(stages):
                rec[s].append(ev[j].elapsed_time(ev[j + 1]))
        rec["step"].append(ev[0].elapsed_time(ev[-1]))
        rec["wall"].append(wall)

    def copy():
        torch.cuda.synchronize()
        ev[0].record()
        copy_dst.copy_(grad0)
        ev[1].record()
        torch.cuda.synchronize()
        copy_ms.append(ev[0].elapsed_time(ev[1]))

    for warm in (True, False):
        for _ in range(3 if warm else reps):
            for name in pipelines:
                for impl in impls:
                    timed(name, impl)
            copy()
        if warm:
            for rec in times.values():
                for lst in rec.values():
                    lst.clear()
            copy_ms.clear()
    cp = _median(copy_ms)
    copy_gbps = 8 * n / (cp * 1e-3) / 1e9
    out["copy"] = {"ms": round(cp, 4), "GBps": round(copy_gbps, 1)}
    table = {}
    for (name, impl), rec in times.items():
        row = {s: round(_median(v), 4) if v else None for s, v in rec.items()}
        bw = {}
        for s in stages:
            if row[s] is None:
                continue
            b = bytes_min[name][s]
            bw[s] = {"bytes": b, "GBps": round(b / (row[s] * 1e-3) / 1e9, 1),
                     "of_copy": round(b / (row[s] * 1e-3) / 1e9 / copy_gbps, 3)}
        total = sum(bytes_min[name].values())
        bw["step"] = {"bytes": total, "GBps": round(total / (row["step"] * 1e-3) / 1e9, 1),
                      "of_copy": round(total / (row["step"] * 1e-3) / 1e9 / copy_gbps, 3),
                      "floor_ms": round(total / (copy_gbps * 1e9) * 1e3, 4)}
        table[f"{name}/{impl}"] = {"median_ms": row, "bandwidth": bw}
    out["timing"] = table
    out["graph_counts"] = dict(graphed.counts)
    try:  # a side measurement: its failure must not lose the part
        out["norms_tiles"] = _norms_tiles(n, g, r, spare, grad0, res0, copy_gbps)
    except Exception as exc:  # noqa: BLE001
        out["norms_tiles_error"] = repr(exc)
    out["speedup_vs_torch"] = {
        f"{name}/{impl}": round(table[f"{name}/torch"]["median_ms"]["step"]
                                / table[f"{name}/{impl}"]["median_ms"]["step"], 2)
        for name in pipelines for impl in impls if impl != "torch"}
    return out


def _norms_tiles(n, g, r, spare, grad0, res0, copy_gbps) -> list[dict]:
    """The Triton norms pass (error feedback: 16 B per element) under other tile sizes and
    warps per program, for choosing the defaults (kernels/triton_kernels.py _TILE, _TILE_WARPS).
    Timed alone with CUDA events, medians of 20."""
    import torch

    from gradientflow import kernels as K

    if K._triton() is None:
        return []
    T = K._triton()
    saved = T._TILE, T._TILE_WARPS
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    rows = []
    try:
        for tile, warps in ((8192, 8), (4096, 4), (2048, 4), (4096, 8), (16384, 8)):
            T._TILE, T._TILE_WARPS = tile, warps
            times = []
            for rep in range(23):
                g.copy_(grad0)
                r.copy_(res0)
                torch.cuda.synchronize()
                ev[0].record()
                T.chunk_norms(g, r, CHUNK, "l1", v_out=spare, zero_grad=True)
                ev[1].record()
                torch.cuda.synchronize()
                if rep >= 3:
                    times.append(ev[0].elapsed_time(ev[1]))
            ms = _median(times)
            gbps = 16 * n / (ms * 1e-3) / 1e9
            rows.append({"tile": tile, "warps": warps, "ms": round(ms, 4),
                         "GBps": round(gbps, 1), "of_copy": round(gbps / copy_gbps, 3)})
    finally:
        T._TILE, T._TILE_WARPS = saved
    return rows


def part_ddp(quick: bool) -> dict:
    """ResNet-50 DDP training steps on one GPU over gradientflow: no hook, FP16, CSC 1%."""
    import torch
    import torch.distributed as dist
    import torchvision
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradientflow
    from gradientflow.compression import CompressionConfig

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("gradientflow", init_method=f"file://{tempfile.mktemp()}", rank=0,
                            world_size=1)
    batch = 32 if quick else 64
    steps, warm = (4, 2) if quick else (20, 5)
    x = torch.randn(batch, 3, 224, 224, device=dev)
    y = torch.randint(0, 1000, (batch,), device=dev)
    variants = {}
    for name in ("no hook", "fp16 hook", "csc hook"):
        torch.manual_seed(0)
        model = DDP(torchvision.models.resnet50().to(dev), device_ids=[0],
                    gradient_as_bucket_view=True)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        if name == "fp16 hook":
            gradientflow.hooks.register(model, CompressionConfig(method="fp16"))
        elif name == "csc hook":
            # the sparse steady state: no dense warm-up stage
            gradientflow.hooks.register(
                model, CompressionConfig(method="csc", density=DENSITY, warmup_densities=()),
                optimizer=opt)
        variants[name] = (model, opt)
    loss_fn = torch.nn.CrossEntropyLoss()
    ms = {name: [] for name in variants}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(warm + steps):
        for name, (model, opt) in variants.items():
            torch.cuda.synchronize()
            start.record()
            opt.zero_grad(set_to_none=False)
            loss_fn(model(x), y).backward()
            opt.step()
            end.record()
            torch.cuda.synchronize()
            if i >= warm:
                ms[name].append(start.elapsed_time(end))
    med = {name: round(_median(v), 3) for name, v in ms.items()}
    paired = {name: round(_median([a - b for a, b in zip(ms[name], ms["no hook"])]), 3)
              for name in ms if name != "no hook"}
    stats = gradientflow.stats()
    dist.destroy_process_group()
    return {"model": "torchvision resnet50", "batch": batch, "steps": steps, "warmup": warm,
            "median_step_ms": med, "added_ms_paired_median": paired,
            "numel": sum(p.numel() for p in variants["no hook"][0].parameters()),
            "stats_ratio": stats.get("ratio"), "precision": "fp32 (TF32 as torch's default)"}


# ---------------------------------------------------------------------------------- driver


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> dict:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(5, timeout), cwd=ROOT,
                           env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        return {"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr,
                "seconds": round(time.perf_counter() - t0, 1)}
    except subprocess.TimeoutExpired as exc:
        def text(x):
            return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")

        return {"rc": "timeout", "stdout": text(exc.stdout), "stderr": text(exc.stderr),
                "seconds": round(time.perf_counter() - t0, 1)}


def _inner(part: str, quick: bool, timeout: float) -> dict:
    """Run one in-process part in a child interpreter; its JSON comes back on a file."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    r = _run([sys.executable, __file__, "--inner", part, "--inner-out", path]
             + (["--quick"] if quick else []), timeout=timeout)
    try:
        data = json.loads(Path(path).read_text())
    except Exception:  # noqa: BLE001 - the part died: its log says why
        data = None
    return {"result": data, "rc": r["rc"], "seconds": r["seconds"], "ok": data is not None,
            "log_tail": (r["stdout"] + r["stderr"])[-6000:]}


def _script(part: str, args: list[str], timeout: float, env: dict | None = None) -> dict:
    """Run one of tests/gpu's scripts; it writes its JSON to a file we name."""
    path = Path(tempfile.mktemp(suffix=".json"))
    r = _run([sys.executable, *args, str(path)], timeout=timeout, env=env)
    data = json.loads(path.read_text()) if path.exists() else None
    return {"result": data, "rc": r["rc"], "seconds": r["seconds"], "ok": r["rc"] == 0,
            "log_tail": (r["stdout"] + r["stderr"])[-6000:]}


def _kernels_md(kern: dict) -> list[str]:
    lines = [f"### CSC step, {kern['numel']:,} elements, chunk {kern['chunk']}, k = {kern['k']} "
             f"of {kern['nchunks']} chunks, FP16 wire (medians of {kern['reps']} reps, CUDA "
             "events around the host calls, implementations alternating)", "",
             f"Device copy of the gradient (8 B per element read + written): "
             f"{kern['copy']['ms']:.3f} ms, {kern['copy']['GBps']} GB/s.", "",
             "Step time and speed-up over the torch reference in the same run:", "",
             "| pipeline | " + " | ".join(f"{i} ms" for i in kern["impls"])
             + " | " + " | ".join(f"torch / {i}" for i in kern["impls"] if i != "torch")
             + " | floor ms |",
             "|---|" + "---:|" * (2 * len(kern["impls"])) + ""]
    for name in ("ef", "ef_momentum", "inplace"):
        t = {i: kern["timing"][f"{name}/{i}"] for i in kern["impls"]}
        cells = [f"{t[i]['median_ms']['step']:.3f}" for i in kern["impls"]]
        ups = [f"{kern['speedup_vs_torch'][f'{name}/{i}']:.2f}x" for i in kern["impls"]
               if i != "torch"]
        floor = t[kern["impls"][0]]["bandwidth"]["step"]["floor_ms"]
        lines.append(f"| {name} | " + " | ".join(cells + ups) + f" | {floor:.3f} |")
    if "graph" in kern["impls"]:
        lines += ["", "graph: the Triton pipeline captured as one CUDA graph per layout "
                  "(`kernels.StepGraphs`) and replayed, timed as a whole step; its calls: "
                  + ", ".join(f"{n} {c}" for n, c in kern.get("graph_counts", {}).items())
                  + " (\"failed\" > 0: a capture failed and that pipeline ran eagerly)."]
    lines += ["", "Per stage (ms, and the fewest bytes the stage must move over its time, as a "
              "fraction of the copy's bandwidth):", "",
              "| pipeline / impl | norms | select | pack | unpack | step | wall |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for key, row in kern["timing"].items():
        m, bw = row["median_ms"], row["bandwidth"]
        cells = [f"{m[s]:.3f} ({bw[s]['of_copy']:.2f})" if m[s] is not None else "-"
                 for s in ("norms", "select", "pack", "unpack", "step")]
        lines.append(f"| {key} | " + " | ".join(cells) + f" | {m['wall']:.3f} |")
    if kern.get("norms_tiles"):
        lines += ["", "The Triton norms pass alone (16 B per element) by tile and warps per "
                  "program (the first row is the default):", "",
                  "| tile | warps | ms | GB/s | of copy |", "|---:|---:|---:|---:|---:|"]
        lines += [f"| {t['tile']} | {t['warps']} | {t['ms']:.3f} | {t['GBps']} | "
                  f"{t['of_copy']:.2f} |" for t in kern["norms_tiles"]]
    lines += ["", "Results against the torch reference at this size:", "",
              "| pipeline / impl | norms max rel err | same chunks | packed bits differ | "
              "grad bits differ | residual bits differ |", "|---|---:|---|---:|---:|---:|"]
    for key, c in kern["compare"].items():
        lines.append(f"| {key} | {c['norms_max_rel_err']:.1e} | {c['same_selection']} | "
                     f"{c['packed_bits_differ']} | {c['grad_bits_differ']} | "
                     f"{c['residual_bits_differ']} |")
    return lines + [""]


def _markdown(rep: dict) -> str:
    env = (rep.get("env") or {}).get("result") or {}
    lines = ["## GPU check", "",
             f"Device: {env.get('device')} ({env.get('sms')} SMs, {env.get('mem_gib')} GiB, "
             f"compute capability {env.get('capability')}); torch {env.get('torch')} (CUDA "
             f"{env.get('torch_cuda')}), NCCL {env.get('nccl')}, Triton {env.get('triton')}, "
             f"numba {env.get('numba')}, numba-cuda {env.get('numba-cuda')}, Python "
             f"{env.get('python')}. Backend base class: {env.get('backend_base')}. CUDA kernels "
             f"in use: Triton {env.get('triton_kernels')}, numba {env.get('numba_cuda_kernels')}.",
             "", f"Command: `{rep['command']}`; written {rep['written']}.", "",
             "| part | passed | seconds |", "|---|---|---:|"]
    for part in PARTS:
        if part in rep:
            p = rep[part]
            lines.append(f"| {part} | {'yes' if p.get('ok') else '**NO**'} | "
                         f"{p.get('seconds', '')} |")
    lines.append("")
    kern = (rep.get("kernels") or {}).get("result")
    if kern:
        lines += _kernels_md(kern)
    elif "kernels" in rep:
        lines += ["### CSC kernels: no result", "", "```", rep["kernels"]["log_tail"][-2000:],
                  "```", ""]
    ddp = (rep.get("ddp") or {}).get("result")
    if ddp:
        lines += [f"### DDP training step, {ddp['model']}, batch {ddp['batch']}, world size 1 "
                  f"over gradientflow (NCCL), {ddp['precision']}; medians of {ddp['steps']} steps "
                  "after warm-up, variants alternating", "",
                  "| variant | step ms | added ms (paired median) |", "|---|---:|---:|"]
        for name, v in ddp["median_step_ms"].items():
            lines.append(f"| {name} | {v:.2f} | {ddp['added_ms_paired_median'].get(name, '')} |")
        lines.append("")
    elif "ddp" in rep:
        lines += ["### DDP step: no result", "", "```", rep["ddp"]["log_tail"][-2000:], "```", ""]
    w1 = (rep.get("world1") or {}).get("result")
    if w1:
        lines += [f"### Backend over NCCL, world size 1 (mode {w1.get('mode')})", "",
                  "| check | ok | s | details / error |", "|---|---|---:|---|"]
        for c in w1["checks"]:
            det = c.get("error") or json.dumps(c.get("details", ""), default=str)
            lines.append(f"| {c['name']} | {'yes' if c['ok'] else '**NO**'} | "
                         f"{c.get('seconds', '')} | {det[:300].replace('|', '/')} |")
        lines.append("")
    elif "world1" in rep:
        lines += ["### World size 1: no result", "", "```", rep["world1"]["log_tail"][-2000:],
                  "```", ""]
    two = (rep.get("two_ranks") or {}).get("result")
    if two:
        lines += [f"### Two ranks on one GPU over gradientflow, CUDA tensors on "
                  f"{two['transport']} ({two['seconds']} s, hung ranks: {two['hung_ranks']})", "",
                  "| check | rank 0 | rank 1 |", "|---|---|---|"]
        names = [rec["name"] for rec in two["ranks"][0]]
        for nm in names:
            cells = []
            for recs in two["ranks"]:
                rec = next((x for x in recs if x["name"] == nm), None)
                cells.append("ok" if rec and rec["ok"] else
                             f"**{((rec or {}).get('error') or 'missing')[:200]}**")
            lines.append(f"| {nm} | " + " | ".join(c.replace("|", "/") for c in cells) + " |")
        lines.append("")
    elif "two_ranks" in rep:
        lines += ["### Two ranks: no result", "", "```", rep["two_ranks"]["log_tail"][-2000:],
                  "```", ""]
    pt = rep.get("pytest")
    if pt:
        tail = [ln for ln in (pt.get("log_tail") or "").splitlines() if ln.strip()][-1:]
        lines += ["### pytest tests/gpu (the CUDA kernels against the reference, on the GPU)", "",
                  f"rc={pt['rc']}, {pt['seconds']} s: {tail[0] if tail else ''}", ""]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 M elements, few reps and steps")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_check"),
                    help="folder for gpu_check.md and gpu_check.json")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    ap.add_argument("--budget-s", type=float, default=450.0,
                    help="seconds for the whole run: a part that would start past it is skipped")
    ap.add_argument("--inner", help=argparse.SUPPRESS)
    ap.add_argument("--inner-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.inner:
        importable_checkout()
        fn = {"env": part_env, "kernels": lambda: part_kernels(args.quick),
              "ddp": lambda: part_ddp(args.quick)}[args.inner]
        data = fn()
        Path(args.inner_out).write_text(json.dumps(data, indent=1, default=str))
        print(json.dumps(data, default=str)[:3000])
        return 0
    try:
        import torch
    except ImportError as exc:
        print(f"gpu_check: {sys.executable} cannot import torch ({exc}); run it with a python "
              "that has torch, on a machine with a GPU. Nothing was measured.", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device (torch.cuda.is_available() is False); run "
              "it on a machine with a GPU. Nothing was measured.", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    importable_checkout()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [os.path.relpath(__file__, ROOT), *(argv or sys.argv[1:])]
    rep: dict = {"command": "python " + " ".join(cmd),
                 "written": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for part in args.parts.split(","):
        left = args.budget_s - (time.perf_counter() - t_start)
        if left < 20:
            rep[part] = {"ok": False, "seconds": 0, "log_tail": "skipped: out of time budget"}
            print(f"== {part}: skipped (budget)", flush=True)
            continue
        limit = min(PART_LIMIT_S[part], left)
        print(f"== {part} (limit {limit:.0f} s)", flush=True)
        if part in ("env", "kernels", "ddp"):
            rep[part] = _inner(part, args.quick, limit)
        elif part == "world1":
            rep[part] = _script(part, ["tests/gpu/_world1.py"], limit,
                                env={"GF_WORLD1_DEVICE": "cuda:0",
                                     "GF_WORLD1_CHECK_TIMEOUT_S": "60"})
        elif part == "two_ranks":
            rep[part] = _script(part, ["tests/gpu/_two_ranks.py"], limit,
                                env={"GF_TWO_DEADLINE_S": str(max(30, limit - 15))})
        elif part == "pytest":
            # -P: the checkout's own folder must not come before the importable copy (its
            # gradientflow/ has no kernels/).
            # tests/gpu only: the CPU kernel tests' subprocesses would need an install here.
            r = _run([sys.executable, "-P", "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider",
                      "tests/gpu", "--deselect",
                      "tests/gpu/test_nccl.py::test_backend_world1_on_cuda"], timeout=limit)
            (out / "gpu_check_pytest.log").write_text(r["stdout"] + "\n" + r["stderr"])
            rep[part] = {"rc": r["rc"], "seconds": r["seconds"], "ok": r["rc"] == 0,
                         "log_tail": r["stdout"][-6000:]}
        print(json.dumps(rep[part].get("result"), default=str)[:2500] if rep[part].get("result")
              else rep[part].get("log_tail", "")[-2500:], flush=True)
        print(f"   ({rep[part].get('seconds')} s, ok={rep[part].get('ok')})", flush=True)
        # Written after every part: a run stopped at its time limit keeps what it measured.
        (out / "gpu_check.json").write_text(json.dumps(rep, indent=1, default=str) + "\n")
        (out / "gpu_check.md").write_text(_markdown(rep))
    md = _markdown(rep)
    print(md)
    return 0 if all(rep[p].get("ok") for p in args.parts.split(",")) else 1


if __name__ == "__main__":
    sys.exit(main())
