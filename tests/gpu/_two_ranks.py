"""Two ranks on one GPU: what NCCL does (run by benchmarks/gpu_check.py; not a test).

``python _two_ranks.py BACKEND RESULT.json`` starts 2 processes that both use cuda:0 and
all_reduce a CUDA tensor of ones over BACKEND: "gradientflow", "cpu:gloo,cuda:nccl" (torch's own,
for comparison) or "transport" (our backend's NCCL factory, ``Transports``, on a FileStore:
what the backend does on first CUDA use, runnable on a torch that cannot construct the
backend); each writes what happened. NCCL refuses two ranks on one device ("Duplicate GPU
detected") from 2.x on; this records the message, or the result if it ran.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp


def worker(rank, backend, init_file, out_dir):
    import torch.distributed as dist

    import gradientflow  # noqa: F401 - registers the backend

    rec = {"rank": rank}
    t0 = time.perf_counter()
    try:
        import datetime

        timeout = datetime.timedelta(seconds=30)
        torch.cuda.set_device(0)
        x = torch.ones(1024, device="cuda:0") * (rank + 1)
        c = torch.ones(4) * (rank + 1)
        if backend == "transport":
            from gradientflow.backend.transports import Transports

            tp = Transports(dist.FileStore(init_file, 2), rank, 2, timeout)
            tp.get(torch.device("cpu")).allreduce([c]).wait()
            rec["cpu_allreduce"] = c.tolist()
            rec["transport"] = type(tp.get(x.device)).__name__
            tp.get(x.device).allreduce([x]).wait()
        else:
            dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                    world_size=2, timeout=timeout)
            dist.all_reduce(c)  # CPU over gloo works regardless
            rec["cpu_allreduce"] = c.tolist()
            dist.all_reduce(x)
        torch.cuda.synchronize()
        rec["cuda_allreduce_first"] = float(x[0])
        rec["ok"] = bool((x == 3).all())
    except BaseException as exc:  # noqa: BLE001
        rec["ok"] = False
        rec["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        rec["traceback"] = traceback.format_exc()[-3000:]
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)
    os._exit(0)  # a failed NCCL communicator can hang the interpreter's teardown


def main() -> int:
    backend, out = sys.argv[1], sys.argv[2]
    out_dir = tempfile.mkdtemp()
    init_file = tempfile.mktemp(prefix="gf-two-")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, backend, init_file, out_dir)) for r in range(2)]
    [p.start() for p in procs]
    deadline = time.time() + 75
    for p in procs:
        p.join(max(1, deadline - time.time()))
    hung = [i for i, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    ranks = []
    for r in range(2):
        path = os.path.join(out_dir, f"rank{r}.json")
        missing = {"rank": r, "ok": False, "error": "no result (hung or killed)"}
        ranks.append(json.load(open(path)) if os.path.exists(path) else missing)
    result = {"backend": backend, "hung_ranks": hung, "ranks": ranks}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result)[:3000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
