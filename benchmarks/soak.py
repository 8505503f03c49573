"""Soak and fault injection for gradientflow, and the per-call cost of its default checks.

    python benchmarks/soak.py [--quick] [--out DIR]            # fault soak (kills ranks)
    python benchmarks/soak.py --overhead [--quick] [--out DIR]  # inspector cost per call
    python benchmarks/soak.py --stress [--quick] [--out DIR]    # 10,000 mixed async ops, 4 ranks
    python benchmarks/soak.py --restart [--quick] [--out DIR]   # torchrun restarts + residuals

Soak: each run starts a small DDP training on gradientflow (2 or 3 ranks, a few seconds),
SIGKILLs one rank at a random moment (the parent picks the rank and the time) and watches the
survivors: each must raise within the process-group timeout (a survivor alive past it is a
hang) and none may finish training as if nothing happened (a wrong result). One run in four
injects no fault and checks the trained weights against a single-process reference instead
(a mismatch is a wrong result). Reports runs, faults injected, hangs, wrong results and the
time from the kill to the first survivor's error (median, max).

Restart (--restart): the experiment's training (experiments/imagenet/train.py, digits, CSC at
1%, per-rank checkpoint shards) under `torchrun --max-restarts 1 --resume auto`, the last rank
SIGKILLing itself at a random step of the second epoch in the first attempt. Each run must exit
0, resume from the checkpoint with the residuals it saved (checksums logged at save and load),
and end with the parameters of one uninterrupted run (else a wrong result). Reports runs,
faults, hangs, wrong results, restarts that resumed, and the time from the kill until torchrun
started the new attempt.

Overhead: 2 ranks; the same gradientflow group with its inspector on and off (toggled in
place, blocks interleaved, medians), plain gloo beside it, at 4 KB and 1 MB.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script: the restart scenario is imported from experiments/


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int, timeout_s: float) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    import gradientflow  # noqa: F401 - registers the backend

    torch.set_num_threads(1)
    dist.init_process_group("gradientflow", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 10))


def _batch(step: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)


def _reference(world: int, steps: int):
    """Single-process training on the union of the ranks' batches (what DDP must equal)."""
    import torch

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        opt.zero_grad()
        loss = 0.0
        for r in range(world):
            x, y = _batch(step, r)
            loss = loss + torch.nn.functional.cross_entropy(model(x), y) / world
        loss.backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train_worker(rank: int, world: int, port: int, steps: int, timeout_s: float, out: str) -> None:
    """One rank of a soak run: DDP training; writes its events as JSON lines to `out`."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    def emit(**ev):
        ev["t"] = time.time()
        with open(out, "a") as f:
            f.write(json.dumps(ev) + "\n")

    try:
        _init(rank, world, port, timeout_s)
        model = _model()
        ddp = DDP(model, bucket_cap_mb=0.1)  # several buckets: the fused async path
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        emit(event="started")
        for step in range(steps):
            opt.zero_grad()
            x, y = _batch(step, rank)
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            if step % 10 == 0:  # an eager collective now and then, as real loops have
                flag = torch.ones(1)
                dist.all_reduce(flag)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        emit(event="done", weights=flat.tolist())
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        emit(event="error", type=type(exc).__name__, msg=str(exc)[:3000])
        os._exit(1)


def _events(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def soak_run(world: int, steps: int, timeout_s: float, fault: bool, rng: random.Random,
             workdir: str) -> dict:
    """One run: start `world` ranks, maybe kill one at a random moment, judge the outcome."""
    port = _free_port()
    outs = [os.path.join(workdir, f"r{rng.random():.9f}-{r}.jsonl") for r in range(world)]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("GRADIENTFLOW_")}
    procs = [subprocess.Popen([sys.executable, "-c",
                               f"import sys; sys.path.insert(0, {ROOT!r}); "
                               "from benchmarks.soak import train_worker as w; "
                               f"w({r}, {world}, {port}, {steps}, {timeout_s!r}, {outs[r]!r})"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for r in range(world)]
    result = {"world": world, "fault": fault, "hang": False, "wrong": False, "detect_s": None}
    try:
        start_deadline = time.monotonic() + 120
        while not all(any(e["event"] == "started" for e in _events(o)) for o in outs):
            if time.monotonic() > start_deadline or any(p.poll() is not None for p in procs):
                result["error"] = "ranks did not start"
                return result
            time.sleep(0.05)  # polling the children's files, not synchronising them
        victim, kill_t = None, None
        if fault:
            victim = rng.randrange(world)
            time.sleep(rng.uniform(0.0, 2.5))  # the random moment of the fault
            if procs[victim].poll() is None:
                kill_t = time.time()
                os.kill(procs[victim].pid, signal.SIGKILL)
            result.update(victim=victim, killed=kill_t is not None)
        deadline = time.monotonic() + timeout_s + 30  # the group timeout, plus exit time
        for r, p in enumerate(procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                result["hang"] = True
                result.setdefault("hung_ranks", []).append(r)
        evs = [_events(o) for o in outs]
        if fault and kill_t is not None:
            errs = [e for r, ev in enumerate(evs) if r != victim
                    for e in ev if e["event"] == "error"]
            done = [r for r, ev in enumerate(evs) if r != victim
                    and any(e["event"] == "done" for e in ev)]
            if done:
                # A survivor finished after its peer was killed: only right if the victim had
                # already finished its last collective (it was killed at its very end).
                vdone = any(e["event"] == "done" for e in evs[victim])
                if not vdone:
                    result["wrong"] = True
                    result["wrong_why"] = f"ranks {done} finished although rank {victim} died"
            survivors = [r for r in range(world) if r != victim]
            raised = {r for r, ev in enumerate(evs) if r != victim
                      and any(e["event"] == "error" for e in ev)}
            if errs:
                # Time until *every* survivor raised (the first one alone flatters).
                result["detect_first_s"] = min(e["t"] for e in errs) - kill_t
                result["detect_s"] = max(e["t"] for e in errs) - kill_t
                result["errors"] = sorted({e["msg"][:300] for e in errs})
            result["survivors_raised"] = f"{len(raised)}/{len(survivors)}"
            # A clear error names the killed rank as dead (the inspector's PeerFailureError).
            named = {r for r, ev in enumerate(evs) if r != victim and any(
                e["event"] == "error" and f"Rank(s) [{victim}] died" in e["msg"] for e in ev)}
            result["named_dead_rank"] = len(named) == len(survivors)
            if len(raised) < len(survivors):
                result["detect_s"] = None  # counted as undetected unless a hang or wrong
        elif not fault:
            import torch

            ref = _reference(world, steps)
            for r, ev in enumerate(evs):
                done = [e for e in ev if e["event"] == "done"]
                if not done:
                    result["wrong"] = True
                    result["wrong_why"] = f"rank {r} did not finish a fault-free run: " + str(
                        [e.get("msg") for e in ev if e["event"] == "error"])[:300]
                    break
                diff = float((torch.tensor(done[0]["weights"]) - ref).abs().max())
                if diff > 1e-4:
                    result["wrong"] = True
                    result["wrong_why"] = f"rank {r} weights differ from the reference by {diff}"
        return result
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            if p.stderr:
                p.stderr.close()


def soak(args) -> dict:
    rng = random.Random(args.seed)
    runs = []
    t_end = time.monotonic() + args.budget_s
    with tempfile.TemporaryDirectory(prefix="gf-soak-") as work:
        for i in range(args.runs):
            if time.monotonic() > t_end:
                break
            world = 2 + (i % 2) if args.max_world >= 3 else 2
            fault = i % 4 != 3
            t0 = time.monotonic()
            r = soak_run(world, args.steps, args.timeout_s, fault, rng, work)
            r["run_s"] = round(time.monotonic() - t0, 1)
            runs.append(r)
            print(f"run {i}: world {world} fault {fault} -> hang {r['hang']} wrong {r['wrong']} "
                  f"detect {r['detect_s']} ({r['run_s']} s)", flush=True)
    injected = [r for r in runs if r.get("killed")]
    detect = [r["detect_s"] for r in injected if r["detect_s"] is not None]
    summary = {
        "runs": len(runs), "faults_injected": len(injected),
        "hangs": sum(r["hang"] for r in runs), "wrong_results": sum(r["wrong"] for r in runs),
        "undetected": sum(1 for r in injected if r["detect_s"] is None and not r["wrong"]),
        "named_dead_rank": sum(1 for r in injected if r.get("named_dead_rank")),
        "detect_median_s": statistics.median(detect) if detect else None,
        "detect_max_s": max(detect) if detect else None,
        "timeout_s": args.timeout_s, "runs_detail": runs,
    }
    return summary


# ---------------------------------------------------------------------- overhead
def overhead_worker(rank: int, world: int, port: int, reps: int, out: str) -> None:
    """Per-call time of sync allreduce: inspector on vs off on the same group, and gloo."""
    import torch
    import torch.distributed as dist

    from gradientflow.backend.registry import backend_of

    _init(rank, world, port, 120)
    insp = backend_of().inspector
    # The engine's front holds the inspector it records to (None: off); toggled per variant.
    issue = backend_of().engine.issue
    # Started with GRADIENTFLOW_DEBUG=1 so the debug check exists; only the "debug" variant
    # uses it (the pre-transport check every call pays in debug mode).
    debug_check = insp.debug
    gloo = dist.new_group(backend="gloo")
    res = {}
    for nbytes, n in ((4096, 100), (2**20, 20)):
        t = torch.ones(nbytes // 4)
        times = {"on": [], "off": [], "gloo": [], "record": [], "debug": []}
        for _ in range(reps):
            for variant in ("on", "off", "gloo", "record", "debug"):
                issue._insp = insp if variant in ("on", "record", "debug") else None
                insp.sliced = variant in ("on", "debug")
                insp.debug = debug_check if variant == "debug" else None
                group = gloo if variant == "gloo" else None
                dist.barrier(group=group)
                t0 = time.perf_counter()
                for _ in range(n):
                    dist.all_reduce(t, group=group)
                times[variant].append((time.perf_counter() - t0) / n * 1e6)
        med = {k: statistics.median(v) for k, v in times.items()}
        # Paired differences (same rep) cancel slow drifts of a loaded machine.
        diffs = [a - b for a, b in zip(times["on"], times["off"])]
        res[str(nbytes)] = {**{f"{k}_us": round(v, 1) for k, v in med.items()},
                            "on_minus_off_us": round(statistics.median(diffs), 2),
                            "record_minus_off_us": round(statistics.median(
                                [a - b for a, b in zip(times["record"], times["off"])]), 2),
                            "debug_minus_on_us": round(statistics.median(
                                [a - b for a, b in zip(times["debug"], times["on"])]), 2)}
    issue._insp = insp
    insp.debug = None
    # The CPU cost the checks add to one call, without the transport (whose time on a loaded
    # 2-core machine varies by far more than this): the backend's issue path around an
    # already-completed transport Work, best of several repeats (timeit's convention).
    import timeit

    from torch._C._distributed_c10d import AllreduceOptions

    done_work = gloo.allreduce(torch.ones(1))
    done_work.wait()
    opts = AllreduceOptions()
    opts.asyncOp = False
    x1 = torch.ones(1024)
    cpu = torch.device("cpu")
    for variant in ("on", "off"):
        issue._insp = insp if variant == "on" else None
        best = min(timeit.repeat(
            lambda: issue._issue("all_reduce", lambda seq: done_work, x1, opts, cpu),
            number=20000, repeat=7)) / 20000 * 1e6
        res[f"issue_path_{variant}_us"] = round(best, 3)
    res["issue_path_added_us"] = round(res["issue_path_on_us"] - res["issue_path_off_us"], 3)
    issue._insp = insp
    # The hot-path cost alone, without the transport: record() as the backend calls it.
    x = torch.ones(1024)
    t0 = time.perf_counter()
    for i in range(20000):
        insp.record(i, "all_reduce", x, None, None, None)
    res["record_only_us"] = round((time.perf_counter() - t0) / 20000 * 1e6, 3)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def overhead(args) -> dict:
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="gf-ovh-") as work:
        out = os.path.join(work, "ovh.json")
        env = {k: v for k, v in os.environ.items() if not k.startswith("GRADIENTFLOW_")}
        env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", GRADIENTFLOW_DEBUG="1")
        procs = [subprocess.Popen([sys.executable, "-c",
                                   f"import sys; sys.path.insert(0, {ROOT!r}); "
                                   "from benchmarks.soak import overhead_worker as w; "
                                   f"w({r}, 2, {port}, {args.reps}, {out!r})"], env=env)
                 for r in range(2)]
        for p in procs:
            p.wait(timeout=900)
        with open(out) as f:
            return json.load(f)


# ---------------------------------------------------------------------- stress
def mixed_program(rank: int, world: int, ops: int, *, seed: int, max_n: int, flush_every: int,
                  on_op=None) -> None:
    """Run `ops` mixed collectives (mostly async allreduces, broadcasts, all_gathers, sync
    allreduces), the same program on every rank (seeded), checking every result; waits on the
    pending Works every `flush_every` operations and at the end. `on_op(i)` runs after op i."""
    import torch
    import torch.distributed as dist

    rng = random.Random(seed)
    pending = []
    for i in range(ops):
        kind = rng.choice(["ar", "ar", "ar", "ar_big", "bcast", "ag", "sync"])
        n = rng.randint(1, max_n)
        if kind == "ar":
            t = torch.full((n,), float(rank))
            pending.append((dist.all_reduce(t, async_op=True), t, float(sum(range(world)))))
        elif kind == "ar_big":
            t = torch.full((n * 100,), 1.0)
            pending.append((dist.all_reduce(t, async_op=True), t, float(world)))
        elif kind == "bcast":
            t = torch.full((n,), float(rank))
            pending.append((dist.broadcast(t, src=i % world, async_op=True), t, float(i % world)))
        elif kind == "ag":
            outs = [torch.empty(n) for _ in range(world)]
            dist.all_gather(outs, torch.full((n,), float(rank)))
            assert all(o[0].item() == r for r, o in enumerate(outs))
        else:
            t = torch.ones(n)
            dist.all_reduce(t)
            assert t[0].item() == world
        if len(pending) >= flush_every or i == ops - 1:
            for w, t, want in pending:
                w.wait()
                assert t[0].item() == want and t[-1].item() == want, (i, want, t[0].item())
            pending.clear()
        if on_op is not None:
            on_op(i)


def stress_worker(rank: int, world: int, port: int, ops: int, out: str) -> None:
    """10,000 mixed operations (mostly async) on every rank, the same program everywhere;
    results checked, RSS sampled every 1,000 operations."""
    import torch.distributed as dist

    _init(rank, world, port, 60)

    def rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    rss = []
    t0 = time.time()

    def sample(i: int) -> None:
        if i % 1000 == 0:
            rss.append(round(rss_mb(), 1))

    mixed_program(rank, world, ops, seed=7, max_n=2000, flush_every=64, on_op=sample)
    rss.append(round(rss_mb(), 1))
    with open(out + f".{rank}", "w") as f:
        json.dump({"rss_mb": rss, "seconds": round(time.time() - t0, 1)}, f)
    dist.destroy_process_group()


def stress(args) -> dict:
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="gf-stress-") as work:
        out = os.path.join(work, "stress")
        env = {k: v for k, v in os.environ.items() if not k.startswith("GRADIENTFLOW_")}
        env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
        ops = 2000 if args.quick else 10000
        procs = [subprocess.Popen([sys.executable, "-c",
                                   f"import sys; sys.path.insert(0, {ROOT!r}); "
                                   "from benchmarks.soak import stress_worker as w; "
                                   f"w({r}, 4, {port}, {ops}, {out!r})"], env=env)
                 for r in range(4)]
        hung = False
        for p in procs:
            try:
                p.wait(timeout=900)
            except subprocess.TimeoutExpired:
                hung = True
                p.kill()
        res = {"ops": ops, "ranks": 4, "deadlock": hung,
               "exit_codes": [p.returncode for p in procs]}
        for r in range(4):
            path = f"{out}.{r}"
            if os.path.exists(path):
                with open(path) as f:
                    res[f"rank{r}"] = json.load(f)
        return res


# ---------------------------------------------------------------------- restart
from experiments.imagenet.restart_scenario import (  # noqa: E402 - shared with the test
    _KILLED, check_resumed, format_logs, launcher_env, prepare_digits, rank_logs,
    restart_command,
)


def restart_run(data: Path, work: Path, kill_at_step: int, timeout_s: float) -> dict:
    """One torchrun job; its outcome, the logs' evidence and its final parameters."""
    import torch

    ckpt, log_dir = work / "ckpt", work / "logs"
    res = {"kill_at_step": kill_at_step, "hang": False, "wrong": False, "resumed": False}
    t0 = time.monotonic()
    try:
        proc = subprocess.run(restart_command(data, ckpt, log_dir, kill_at_step),
                              capture_output=True, text=True, timeout=timeout_s,
                              env=launcher_env(), cwd=work)
        res["rc"] = proc.returncode
    except subprocess.TimeoutExpired:
        res["hang"] = True
    res["run_s"] = round(time.monotonic() - t0, 1)
    logs = rank_logs(log_dir)
    res["logs"] = logs
    if kill_at_step >= 0 and not res["hang"]:
        try:
            res["ranks"] = check_resumed(logs)
            res["resumed"] = True
        except AssertionError as exc:
            res["why"] = str(exc)
        killed = [float(m[2]) for (a, _r), t in logs.items() if a == 0 for m in _KILLED.finditer(t)]
        attempt1 = sorted(log_dir.glob("*/attempt_1"))
        if killed and attempt1:  # torchrun creates the attempt's log folder as it starts it
            res["restart_s"] = round(attempt1[0].stat().st_mtime - killed[0], 2)
    if res.get("rc") == 0 and (ckpt / "checkpoint.pth.tar").is_file():
        res["params"] = torch.load(ckpt / "checkpoint.pth.tar", map_location="cpu",
                                   weights_only=False)["state_dict"]
    return res


def restart_soak(args) -> dict:
    """A reference run without a fault, then runs killed at random steps of the second epoch:
    each must resume with its residuals and end with the reference's parameters."""

    rng = random.Random(args.seed)
    runs = []
    with tempfile.TemporaryDirectory(prefix="gf-restart-") as tmp:
        tmp = Path(tmp)
        data = prepare_digits(tmp / "digits")
        ref = restart_run(data, _mkdir(tmp / "ref"), -1, args.timeout_s)
        if "params" not in ref:
            raise RuntimeError("the reference run without a fault failed:\n"
                               + format_logs(ref["logs"]))
        for i in range(args.runs):
            r = restart_run(data, _mkdir(tmp / f"run{i}"), rng.randrange(3, 6), args.timeout_s)
            params = r.pop("params", None)
            if r["hang"] or r.get("rc") != 0 or not r["resumed"]:
                r["wrong"] = not r["hang"]
            else:
                diff = max(float((params[k] - v).abs().max()) for k, v in ref["params"].items())
                r["max_param_diff"] = diff
                r["wrong"] = diff > 1e-5
                if r["wrong"]:
                    r["why"] = f"final parameters differ from the uninterrupted run's by {diff:g}"
            logs = r.pop("logs")
            if r["wrong"] or r["hang"]:
                r["logs_tail"] = format_logs(logs)[-4000:]
            runs.append(r)
            print(f"restart run {i}: kill at step {r['kill_at_step']} -> rc {r.get('rc')} hang "
                  f"{r['hang']} wrong {r['wrong']} resumed {r['resumed']} restart after "
                  f"{r.get('restart_s')} s ({r['run_s']} s)", flush=True)
    restart = [r["restart_s"] for r in runs if r.get("restart_s") is not None]
    return {"runs": len(runs), "faults_injected": len(runs), "hangs": sum(r["hang"] for r in runs),
            "wrong_results": sum(r["wrong"] for r in runs),
            "resumed": sum(r["resumed"] and not r["wrong"] for r in runs),
            "restart_median_s": statistics.median(restart) if restart else None,
            "restart_max_s": max(restart) if restart else None,
            "reference_run_s": ref["run_s"], "timeout_s": args.timeout_s, "runs_detail": runs}


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _markdown(name: str, res: dict) -> str:
    if name == "soak":
        return ("## Soak: ranks killed at random points of DDP training\n\n"
                "| runs | faults injected | hangs | wrong results | undetected | every survivor "
                "named the dead rank | detect median (s) | detect max (s) | group timeout (s) |\n"
                "|---|---|---|---|---|---|---|---|---|\n"
                f"| {res['runs']} | {res['faults_injected']} | {res['hangs']} | "
                f"{res['wrong_results']} | {res['undetected']} | {res['named_dead_rank']} | "
                f"{_f(res['detect_median_s'])} | {_f(res['detect_max_s'])} | "
                f"{res['timeout_s']} |\n")
    if name == "restart":
        return ("## Restart: torchrun --max-restarts 1, a rank SIGKILLed mid-training, resumed "
                "from its checkpoint (CSC 1% residuals)\n\n"
                "| runs | faults injected | hangs | wrong results | resumed with saved residuals "
                "| kill to restart median (s) | max (s) | one run without fault (s) |\n"
                "|---|---|---|---|---|---|---|---|\n"
                f"| {res['runs']} | {res['faults_injected']} | {res['hangs']} | "
                f"{res['wrong_results']} | {res['resumed']} | {_f(res['restart_median_s'])} | "
                f"{_f(res['restart_max_s'])} | {res['reference_run_s']} |\n\nA wrong result: "
                "the job failed, did not resume, loaded other residuals than it saved, or ended "
                "with other parameters than the uninterrupted run.\n")
    if name == "overhead":
        rows = "".join(f"| {k} | {v['gloo_us']} | {v['off_us']} | {v['on_us']} | "
                       f"{v['on_minus_off_us']} | {v['debug_us']} | {v['debug_minus_on_us']} |\n"
                       for k, v in res.items() if isinstance(v, dict))
        return ("## Inspector overhead (sync all_reduce, 2 ranks, median us per call)\n\n"
                "4 KB and 1 MB both go eagerly (above sync_fusion_limit, 256 B), with no round. "
                "On a shared 2-core machine the transport varies by far more than the "
                "check costs; the CPU line below is the check's own cost.\n\n"
                "The debug column is GRADIENTFLOW_DEBUG=1's check before the transport (a "
                "16-byte allgather of sequence number and fingerprint per call on a side "
                "group): the price of turning every size mismatch gloo aborts on into an "
                "error on every rank.\n\n"
                "| bytes | gloo | gradientflow, inspector off | inspector on | on - off (paired) "
                "| debug check | debug - on (paired) |\n"
                f"|---|---|---|---|---|---|---|\n{rows}\nCPU added per call by the default check "
                f"(issue path "
                f"around a completed Work, best of 7): {res['issue_path_added_us']} us "
                f"({res['issue_path_off_us']} -> {res['issue_path_on_us']}); record() alone: "
                f"{res['record_only_us']} us\n")
    return "## Stress\n\n```\n" + json.dumps(res, indent=1) + "\n```\n"


def _f(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--overhead", action="store_true")
    ap.add_argument("--stress", action="store_true")
    ap.add_argument("--restart", action="store_true")
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--timeout-s", type=float, default=20.0)
    ap.add_argument("--budget-s", type=float, default=1200.0)
    ap.add_argument("--max-world", type=int, default=3)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.overhead:
        name = "overhead"
        args.reps = args.reps or (7 if args.quick else 25)
        res = overhead(args)
    elif args.stress:
        name = "stress"
        res = stress(args)
    elif args.restart:
        name = "restart"
        args.runs = args.runs or (2 if args.quick else 4)
        if args.timeout_s == ap.get_default("timeout_s"):
            args.timeout_s = 300.0  # a whole torchrun job with its restart, not a group timeout
        res = restart_soak(args)
    else:
        name = "soak"
        args.runs = args.runs or (4 if args.quick else 16)
        res = soak(args)
    md = _markdown(name, res)
    print(md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{name}.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(args.out, f"{name}.md"), "w") as f:
            f.write(md)
    return res


if __name__ == "__main__":
    main()
