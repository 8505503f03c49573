"""CSC kernels on ResNet-50's flat gradient: fused numba CPU pipeline vs torch reference vs a copy.

One CSC step without the network, on a 25,557,032-element float32 gradient (torchvision
resnet50's parameter count) with a residual, as the CSC compressor runs it with error feedback:
``chunk_norms`` (residual-add + L1 norms of 1024-element chunks, v written into the spare
residual and the gradient zeroed in the same pass), ``select_chunks`` (1% of the chunks),
``pack_chunks`` (scaled to FP16), ``unpack_sent`` (the sent chunks written into the gradient and
their rounding error into the residual, the packed buffer standing in for the reduced one). The
same calls run with ``impl="numba"`` and ``impl="torch"``; the two-pass pipeline the compressor
used before (v back into the gradient, then ``unpack_update`` over every element) runs beside
them; the same pipeline under DGC's momentum correction (an option of CSC: the velocity read
and its new value written in the ``chunk_norms`` pass) runs with both implementations too; and a
plain ``copy_`` of the gradient's bytes is the memory-bandwidth bound; all alternate rep by rep
at each thread count (torch and numba set to the same count), medians reported.

GB/s: the bytes each variant must move at the least. The one-pass pipeline reads grad and
residual and writes the spare residual and grad: 16 bytes per element (plus k chunks); the
two-pass one reads grad and residual and writes grad (norms pass), then reads grad and writes
residual and grad (unpack pass): 24 bytes per element; the copy reads and writes 8. "vs copy" is
pipeline GB/s over copy GB/s (1.0 would
mean the pipeline streams as fast as a copy). Also the dense FP16 path (cast_scaled +
upcast_scaled) for reference, and the FP16 hook's path with error feedback as it runs per bucket
(``cast_feedback``: residual add + round + rounding error; ``upcast_finite``: upcast + finiteness
count), numba vs the torch reference.

    python -m benchmarks.bench_kernels [--quick] [--out DIR]
"""
from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.common import fmt, machine_line, markdown_table, median, results_dir, write_result
from gradientflow import kernels as K

RESNET50_NUMEL = 25_557_032
CHUNK = 1024
DENSITY = 0.01
# The CSC pipelines timed (with per-stage times), then the other rows, in table order.
PIPELINES = ("numba", "torch", "numba 2-pass", "numba mc", "torch mc")
OTHERS = ("copy", "fp16 numba", "fp16 torch", "fp16ef numba", "fp16ef torch")


def pipeline(grad, res, spare, send, k, impl, stages=None, one_pass=True, mom=None):
    """One CSC step on (grad, res); fills `stages` with per-stage seconds when given.

    one_pass: v into `spare` with grad zeroed, then only the sent chunks written (the
    compressor's path); otherwise v back into grad and a full unpack_update pass (the old path).
    mom: (momentum, momentum_out) for DGC's momentum correction (an option of CSC).
    """
    import time

    t0 = time.perf_counter()
    if one_pass:
        mkw = dict(momentum=mom[0], momentum_out=mom[1], m=0.9) if mom else {}
        norms = K.chunk_norms(grad, res, CHUNK, "l1", v_out=spare, zero_grad=True, impl=impl,
                              **mkw)
        v = spare
    else:
        norms = K.chunk_norms(grad, res, CHUNK, "l1", impl=impl)
        v = grad
    t1 = time.perf_counter()
    idx = K.select_chunks(norms, k, impl=impl)
    t2 = time.perf_counter()
    packed = K.pack_chunks(v, idx, CHUNK, 0.5, torch.float16, out=send[: k * CHUNK], impl=impl)
    local = packed.clone()  # kept for the rounding error while `packed` is reduced in place
    t3 = time.perf_counter()
    if one_pass:
        K.unpack_sent(grad, spare, packed, local, idx, CHUNK, 1.0, 2.0, impl=impl)
    else:
        K.unpack_update(grad, res, packed, local, idx, CHUNK, 1.0, 2.0, out=grad, impl=impl)
    t4 = time.perf_counter()
    if stages is not None:
        for name, dt in (("norms", t1 - t0), ("select", t2 - t1), ("pack", t3 - t2),
                         ("unpack", t4 - t3)):
            stages.setdefault(name, []).append(dt)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 M elements, 3 reps")
    ap.add_argument("--out", default=results_dir("kernels"), help="folder for kernels.json/.md")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    args = ap.parse_args(argv)

    import time

    n = 1_000_000 if args.quick else RESNET50_NUMEL
    reps = args.reps or (3 if args.quick else 9)
    nch = K.nchunks_of(n, CHUNK)
    k = math.ceil(DENSITY * nch)
    gen = torch.Generator().manual_seed(0)
    grad0 = torch.randn(n, generator=gen)
    res0 = torch.randn(n, generator=gen) * 0.1
    grad, res, spare = torch.empty(n), torch.empty(n), torch.empty(n)
    mom = (torch.randn(n, generator=gen) * 0.1, torch.empty(n))  # momentum correction's u
    dst = torch.empty(n)
    send = torch.empty(k * CHUNK, dtype=torch.float16)
    half = torch.empty(n, dtype=torch.float16)
    up = torch.empty(n)
    t_compile = time.perf_counter()
    K.chunk_norms(torch.ones(10), torch.ones(10), 4)  # compile or load the kernels first
    from gradientflow.kernels import cpu

    cpu.warm_up()
    t_compile = time.perf_counter() - t_compile

    rows, stage_rows, results = [], [], []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        K.set_num_threads(threads)
        times = {key: [] for key in PIPELINES + OTHERS}
        stages = {key: {} for key in PIPELINES}
        for rep in range(reps + 1):  # rep 0 warms up (page faults, caches)
            for key in PIPELINES:
                impl = key.split()[0]
                grad.copy_(grad0)
                res.copy_(res0)
                st = {} if rep == 0 else stages[key]
                t0 = time.perf_counter()
                pipeline(grad, res, spare, send, k, impl, st, one_pass=key != "numba 2-pass",
                         mom=mom if key.endswith(" mc") else None)
                if rep:
                    times[key].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            dst.copy_(grad0)
            if rep:
                times["copy"].append(time.perf_counter() - t0)
            for impl in ("numba", "torch"):
                t0 = time.perf_counter()
                K.cast_scaled(grad0, 0.5, torch.float16, out=half, impl=impl)
                K.upcast_scaled(half, 2.0, out=up, impl=impl)
                if rep:
                    times[f"fp16 {impl}"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                K.cast_feedback(grad0, res0, 0.5, torch.float16, 2.0, out=half, residual_out=res,
                                impl=impl)
                K.upcast_finite(half, 1.0, out=up, impl=impl)
                if rep:
                    times[f"fp16ef {impl}"].append(time.perf_counter() - t0)
        med = {key: median(v) for key, v in times.items()}
        # momentum correction also reads u and writes the new u: 24 bytes per element
        moved = {"numba": 16 * n, "torch": 16 * n, "numba 2-pass": 24 * n, "copy": 8 * n,
                 "numba mc": 24 * n, "torch mc": 24 * n,
                 "fp16 numba": 12 * n, "fp16 torch": 12 * n,
                 "fp16ef numba": 18 * n, "fp16ef torch": 18 * n}
        copy_gbps = moved["copy"] / med["copy"] / 1e9
        for key in PIPELINES + OTHERS:
            gbps = moved[key] / med[key] / 1e9
            label = {"numba": "CSC pipeline, numba", "torch": "CSC pipeline, torch reference",
                     "numba 2-pass": "CSC pipeline, numba, two full passes",
                     "numba mc": "CSC pipeline with momentum correction, numba",
                     "torch mc": "CSC pipeline with momentum correction, torch reference",
                     "copy": "copy of the gradient (bound)",
                     "fp16 numba": "dense FP16 cast+upcast, numba",
                     "fp16 torch": "dense FP16 cast+upcast, torch",
                     "fp16ef numba": "FP16 hook with error feedback, numba (2 fused passes)",
                     "fp16ef torch": "FP16 hook with error feedback, torch reference"}[key]
            row = {"threads": threads, "variant": label, "impl": key, "median_ms": med[key] * 1e3,
                   "gbps": gbps, "vs_copy": gbps / copy_gbps,
                   "speedup_vs_torch": (med["torch"] / med[key])
                   if key in ("numba", "torch", "numba 2-pass")
                   else (med["torch mc"] / med[key]) if key.endswith(" mc")
                   else (med["fp16 torch"] / med[key]) if key.startswith("fp16 ")
                   else (med["fp16ef torch"] / med[key]) if key.startswith("fp16ef") else None}
            rows.append(row)
        for impl in PIPELINES:
            srow = {"threads": threads, "impl": impl}
            for name, v in stages[impl].items():
                srow[name] = median(v) * 1e3
            stage_rows.append(srow)
        results.append({"threads": threads, "median_s": med, "stage_ms": stages})
        print(f"threads={threads}: numba {med['numba']*1e3:.1f} ms, "
              f"torch {med['torch']*1e3:.1f} ms ({med['torch']/med['numba']:.2f}x), "
              f"numba two-pass {med['numba 2-pass']*1e3:.1f} ms, "
              f"with momentum correction numba {med['numba mc']*1e3:.1f} ms, "
              f"copy {med['copy']*1e3:.1f} ms", flush=True)

    table = markdown_table(
        ["threads", "variant", "median_ms", "gbps", "vs_copy", "speedup_vs_torch"], rows,
        ["threads", "variant", "median ms", "GB/s", "GB/s vs copy", "speedup vs torch"])
    stage_table = markdown_table(
        ["threads", "impl", "norms", "select", "pack", "unpack"], stage_rows,
        ["threads", "impl", "chunk_norms ms", "select_chunks ms", "pack_chunks ms",
         "unpack_sent (2-pass: unpack_update) ms"])
    md = (
        "## CSC kernels (numba CPU vs torch reference)\n\n"
        f"{n:,} float32 elements with a residual, chunk {CHUNK}, {k} of {nch} chunks (1%) packed "
        f"to FP16; median of {reps} reps per thread count, variants alternating rep by rep. "
        f"Numba threading layer: {K.threading_layer()}; first compile/cache load "
        f"{fmt(t_compile)} s. GB/s counts the least bytes moved (pipeline 16 B/element, the "
        "two-pass one 24, with momentum correction 24, copy 8, "
        f"dense FP16 12, FP16 with error feedback 18: read grad and residual, write the half "
        f"buffer and the new residual, then read the half buffer and write the result).\n\n"
        f"{table}\n\nPer stage (median ms):\n\n{stage_table}\n\n"
        f"{machine_line()}\n"
    )
    print(md)
    write_result(args.out, "kernels", {"numel": n, "chunk": CHUNK, "k": k, "reps": reps,
                                        "threading_layer": K.threading_layer(), "rows": rows,
                                        "stages": stage_rows, "runs": results}, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
