"""Multi-process test harness: a pool of rank processes kept alive for the whole session.

Starting a rank costs seconds (importing torch), so each world size gets one pool of worker
processes, started by spawn (never fork: OpenMP runtimes in the parent break forked
children). A test sends every rank the same task, a function named by file and qualified name;
each rank creates a fresh process group on a fresh store, runs it, destroys the group and
answers with its result or its traceback. A task that does not answer within its timeout gets
every worker of the pool killed (so no test can hang the suite) and an error naming the ranks
that did not answer; the pool restarts on next use.
"""
from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from typing import Any, Callable, Iterator

_CTX = mp.get_context("spawn")


def autoloads_backends() -> bool:
    """Whether this torch loads backend plugins from their entry point (2.14 on)."""
    import torch.distributed as dist

    return hasattr(dist.Backend, "_ensure_backend_registered")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class RankFailure(AssertionError):
    """One or more ranks raised, or did not answer in time."""


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def environ(env: dict) -> Iterator[None]:
    """os.environ with `env` set, as it was again afterwards."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _load(path: str, qualname: str) -> Callable:
    name = "gf_task_" + os.path.splitext(os.path.basename(path))[0]
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    obj = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _worker(rank: int, world_size: int, conn) -> None:
    import faulthandler

    faulthandler.enable()  # a rank that aborts or segfaults prints every thread's stack
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    # The CPU kernels load while the worker waits for its first task, and are ready before it:
    # until then the dispatch runs the torch reference (kernels/warm.py), whose norms may
    # differ from numba's in the last bits, and a test comparing two runs must see one kernel.
    from gradientflow.kernels import warm

    warm.start()
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        warm.wait()
        path, qualname, port, backend, env, pg_timeout_s, args, kwargs = msg
        try:
            with environ(env):
                fn = _load(path, qualname)
                if backend:
                    import datetime

                    if "gradientflow" in backend and not autoloads_backends():
                        import gradientflow  # noqa: F401 - torch < 2.14 has no entry-point autoload
                    dist.init_process_group(
                        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout_s))
                try:
                    result = ("ok", fn(rank, world_size, *args, **kwargs))
                finally:
                    if backend and dist.is_initialized():
                        dist.destroy_process_group()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        try:
            conn.send(result)
        except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable result
            conn.send(("error", f"result could not be sent back: {exc}"))


class RankPool:
    """`world_size` worker processes that run the same task, one process per rank."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._procs: list = []
        self._conns: list = []

    def _start(self) -> None:
        env_path = os.pathsep.join([_ROOT, os.environ.get("PYTHONPATH", "")])
        os.environ["PYTHONPATH"] = env_path
        for rank in range(self.world_size):
            parent, child = _CTX.Pipe()
            p = _CTX.Process(target=_worker, args=(rank, self.world_size, child), daemon=True,
                             name=f"gf-rank{rank}")
            p.start()
            self._procs.append(p)
            self._conns.append(parent)
        deadline = time.monotonic() + 120
        for rank, conn in enumerate(self._conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                self.close()
                raise RankFailure(f"rank {rank} of {self.world_size} did not start in 120 s")
            conn.recv()

    def close(self) -> None:
        """Kill every worker."""
        for conn in self._conns:
            try:
                conn.send(None)
            except Exception:  # noqa: BLE001
                pass
        deadline = time.monotonic() + 3
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs, self._conns = [], []

    def run(self, fn: Callable, *args: Any, backend: str | None = "gradientflow",
            timeout: float = 120.0, env: dict | None = None, pg_timeout_s: float = 60.0,
            **kwargs: Any) -> list[Any]:
        """Run fn(rank, world_size, *args, **kwargs) on every rank; return the results by rank.

        Raises RankFailure naming every rank that raised (with its traceback) or did not
        answer within `timeout` seconds (then the whole pool is killed and restarted later).
        """
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        path = os.path.abspath(sys.modules[fn.__module__].__file__)
        msg = (path, fn.__qualname__, free_port(), backend, dict(env or {}), pg_timeout_s,
               args, kwargs)
        for conn in self._conns:
            conn.send(msg)
        results: list[Any] = [None] * self.world_size
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        for rank, conn in enumerate(self._conns):
            left = max(0.0, deadline - time.monotonic())
            if not conn.poll(left):
                errors[rank] = f"did not answer within {timeout:.0f} s (hang or deadlock)"
                continue
            try:
                status, value = conn.recv()
            except EOFError:
                errors[rank] = "died (its process exited)"
                continue
            if status == "ok":
                results[rank] = value
            else:
                errors[rank] = value
        if errors:
            if any("did not answer" in e or "died" in e for e in errors.values()):
                self.close()
            report = "\n".join(f"--- rank {r}: {e}" for r, e in sorted(errors.items()))
            raise RankFailure(f"{fn.__qualname__} failed on ranks {sorted(errors)} of "
                              f"{self.world_size}:\n{report}")
        return results
