"""Start N rank processes running one Python function; collect each rank's JSON result.

    res = launch("benchmarks.bench_e2e:worker", world_size=2, kwargs={...},
                 cluster=cluster, timeout_s=300)
    if not res.ok: print(res.error)        # names the rank that failed first, and its log tail

Each rank runs ``python -m benchmarks.launch --worker TARGET`` in its namespace (or on
loopback), with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/GLOO_SOCKET_IFNAME set by the cluster.
The worker initialises the default process group on gloo, calls
``TARGET(rank, world_size, **kwargs)`` and writes the returned dict as JSON. All ranks are
killed (their whole process groups) when the time limit passes or shortly after any rank fails,
since the others would otherwise wait on a collective forever.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import sigterm_raises

REPO = Path(__file__).resolve().parent.parent
_FAIL_GRACE_S = 10.0  # how long the other ranks may still finish after one rank failed


@dataclass
class LaunchResult:
    """What came back from one launch: per-rank results, return codes and logs."""

    ok: bool
    results: list[dict | None]
    returncodes: list[int | None]
    error: str = ""
    failed_rank: int | None = None
    wall_s: float = 0.0
    logs: list[str] = field(default_factory=list)


def free_port() -> int:
    """A TCP port that is free on loopback now (good enough for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(text: str, n: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


def launch(target: str, world_size: int, kwargs: dict | None = None, cluster=None,
           timeout_s: float = 600.0, env_extra: dict | None = None,
           threads_per_rank: int = 1) -> LaunchResult:
    """Run `target` ("module:function") on `world_size` ranks; bounded by `timeout_s`.

    Args:
        target: "package.module:function"; called as function(rank, world_size, **kwargs) and
            must return a JSON-serialisable dict.
        cluster: a `benchmarks.netem.Cluster` already entered, or None for plain loopback.
        timeout_s: wall-clock limit for the whole launch; every rank is killed after it.
        threads_per_rank: OMP/MKL threads of each rank (1: one core per rank).
    """
    if cluster is None:
        from benchmarks.netem import Cluster
        cluster = Cluster(world_size)  # not entered: loopback addressing, nothing to create
        cluster.tag, cluster.shaped = "loopback", False
    if cluster.world_size != world_size:
        raise ValueError(f"launch: cluster has {cluster.world_size} ranks, asked for {world_size}")
    # A fresh port per launch: one launch's rendezvous must never meet the previous one's.
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="gfb-launch-"))
    try:
        return _launch_in(tmp, target, world_size, kwargs, cluster, timeout_s, env_extra,
                          threads_per_rank, port)
    finally:  # also on Ctrl-C / SIGTERM: no per-launch files left behind
        shutil.rmtree(tmp, ignore_errors=True)


def _launch_in(tmp: Path, target, world_size, kwargs, cluster, timeout_s, env_extra,
               threads_per_rank, port) -> LaunchResult:
    procs, logs, outs = [], [], []
    base_env = dict(os.environ)
    base_env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + [p for p in base_env.get("PYTHONPATH", "").split(os.pathsep) if p])
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        base_env[var] = str(threads_per_rank)
    base_env.update(env_extra or {})
    t0 = time.monotonic()
    guard = sigterm_raises()
    guard.__enter__()
    try:
        for rank in range(world_size):
            out, log = tmp / f"rank{rank}.json", tmp / f"rank{rank}.log"
            argv = cluster.wrap(rank, [sys.executable, "-m", "benchmarks.launch", "--worker",
                                       target, "--kwargs", json.dumps(kwargs or {}),
                                       "--out", str(out), "--timeout", str(timeout_s)])
            fh = open(log, "w")
            procs.append(subprocess.Popen(argv, env=cluster.env(rank, port, base_env),
                                          cwd=REPO, stdout=fh, stderr=subprocess.STDOUT,
                                          start_new_session=True))
            fh.close()
            logs.append(log)
            outs.append(out)
        failed_rank, timed_out = wait_ranks(procs, timeout_s, start=t0)
    finally:
        for p in procs:
            _kill(p)
        guard.__exit__(None, None, None)
    wall = time.monotonic() - t0
    results, log_texts = [], []
    for out, log in zip(outs, logs):
        results.append(json.loads(out.read_text()) if out.exists() else None)
        log_texts.append(log.read_text(errors="replace") if log.exists() else "")
    codes = [p.returncode for p in procs]
    ok = all(c == 0 for c in codes) and all(r is not None for r in results)
    error = ""
    raised = {}
    for rank, out in enumerate(outs):
        err = Path(str(out) + ".err")
        if err.exists():
            try:
                raised[rank] = json.loads(err.read_text())["time"]
            except (ValueError, KeyError):
                pass
    if not ok and raised:
        failed_rank = min(raised, key=raised.get)  # the first to raise, not the first seen
    if not ok:
        if failed_rank is None:
            failed_rank = next((r for r, res in enumerate(results) if res is None), 0)
        why = (f"timed out after {timeout_s:.0f} s" if timed_out
               else f"exited with code {codes[failed_rank]}")
        error = (f"rank {failed_rank} of {world_size} {why} running {target}; "
                 f"its log ends:\n{_tail(log_texts[failed_rank])}")
    return LaunchResult(ok=ok, results=results, returncodes=codes, error=error,
                        failed_rank=None if ok else failed_rank, wall_s=wall, logs=log_texts)


def wait_ranks(procs: list, timeout_s: float, grace_s: float = _FAIL_GRACE_S,
               start: float | None = None) -> tuple[int | None, bool]:
    """Wait for every rank's process, but stop at the deadline or soon after a failure.

    Returns (the first rank seen exiting non-zero, or None; whether `timeout_s` passed, counted
    from `start`, default now). Stops `grace_s` after the first failure: the other ranks may
    finish, or wait on a collective for ever.
    """
    t0 = time.monotonic() if start is None else start
    failed_rank, failed_at = None, None
    while True:
        codes = [p.poll() for p in procs]
        now = time.monotonic()
        if failed_rank is None:
            bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed_rank, failed_at = bad[0], now
        if all(c is not None for c in codes):
            return failed_rank, False
        if now - t0 > timeout_s:
            return failed_rank, True
        if failed_at is not None and now - failed_at > grace_s:
            return failed_rank, False
        try:
            procs[codes.index(None)].wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def selftest_worker(rank: int, world_size: int, fail_rank: int = -1, hang_rank: int = -1) -> dict:
    """Smoke target: allreduce the rank ids; `fail_rank` raises, `hang_rank` never returns."""
    import threading

    import torch
    import torch.distributed as dist

    if rank == fail_rank:
        raise RuntimeError(f"selftest_worker: rank {rank} fails on purpose")
    if rank == hang_rank:
        threading.Event().wait()  # blocks until the launcher kills us: tests the time limit
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "sum": t.item()}


def _worker(target: str, kwargs: dict, out: str, timeout_s: float) -> int:
    err = Path(out + ".err")

    def record(exc: BaseException) -> None:
        # When one rank raises, its peers fail soon after (connection closed): the time of each
        # rank's first exception, taken before any clean-up, names the rank that failed first.
        if not err.exists():
            err.write_text(json.dumps({"time": time.time(), "error": repr(exc)}))

    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        mod_name, fn_name = target.split(":")
        fn = getattr(importlib.import_module(mod_name), fn_name)
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=max(timeout_s, 30)))
        try:
            result = fn(rank, world, **kwargs)
        except BaseException as exc:
            record(exc)
            raise
        finally:
            dist.destroy_process_group()
    except BaseException as exc:
        record(exc)
        raise
    Path(out).write_text(json.dumps(result))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="internal: one rank of benchmarks.launch")
    ap.add_argument("--worker", required=True, help="module:function to run on this rank")
    ap.add_argument("--kwargs", default="{}")
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    return _worker(args.worker, json.loads(args.kwargs), args.out, args.timeout)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's and the C++ libraries' teardown: with DDP + powerSGD on gloo, a
    # rank that had written its result still aborted at exit ("terminate called without an
    # active exception", SIGABRT) in 2 of 10 quick runs, without any gradientflow code
    # involved, and the launcher then reported the run as failed.
    os._exit(code)
