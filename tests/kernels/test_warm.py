"""The CPU kernels compiled before they are needed (kernels/warm.py): the reference until then."""

import os
import subprocess
import sys
import threading

import torch

from gradientflow import kernels as K
from gradientflow.kernels import reference as R
from gradientflow.kernels import warm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU = torch.device("cpu")


def test_dispatch_runs_the_reference_until_the_kernels_are_ready(monkeypatch):
    assert warm.wait(timeout=300), warm.error()
    from gradientflow.kernels import cpu

    assert K.implementation("chunk_norms", "auto", CPU) is cpu.chunk_norms
    # As if this process had not finished loading them: auto takes the reference, an
    # explicit numba still takes numba, and the result is the same.
    monkeypatch.setattr(warm, "_done", threading.Event())
    monkeypatch.setattr(warm, "_thread", threading.Thread())  # "started": start() does nothing
    assert not warm.ready()
    assert K.implementation("chunk_norms", "auto", CPU) is R.chunk_norms
    assert K.implementation("chunk_norms", "numba", CPU) is cpu.chunk_norms
    g = torch.arange(10, dtype=torch.float32)
    assert torch.equal(K.chunk_norms(g.clone(), None, 4),
                       K.chunk_norms(g.clone(), None, 4, impl="numba"))


def test_a_failed_warm_up_keeps_the_reference(monkeypatch):
    done = threading.Event()
    done.set()
    monkeypatch.setattr(warm, "_done", done)
    monkeypatch.setattr(warm, "_error", RuntimeError("no compiler"))
    assert not warm.ready() and isinstance(warm.error(), RuntimeError)
    assert K.implementation("pack_chunks", "auto", CPU) is R.pack_chunks


def test_the_command_fills_the_cache_a_fresh_process_then_loads(tmp_path):
    """`python -m gradientflow.kernels` (make install runs it) compiles into the cache;
    a new process with that cache is ready without compiling (its warm-up only loads)."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    cmd = [sys.executable, "-m", "gradientflow.kernels"]
    first = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    assert "CPU kernels ready" in first.stdout and str(tmp_path) in first.stdout, first.stdout
    assert any(p.suffix == ".nbi" for p in tmp_path.rglob("*")), "nothing was cached"
    probe = ("from gradientflow.kernels import warm; "
             "assert warm.cached(), 'a filled cache must read as filled (no child compiles)'; "
             "assert warm.wait(300), warm.error(); "
             "from gradientflow.kernels import cpu; import numba; "
             "d = [v for v in vars(cpu).values() if isinstance(v, numba.core.registry"
             ".CPUDispatcher)]; "
             "print(sum(len(x.stats.cache_misses) for x in d), "
             "sum(len(x.stats.cache_hits) for x in d))")
    again = subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    misses, hits = map(int, again.stdout.split())
    assert misses == 0 and hits > 0, again.stdout


def test_a_program_that_ends_while_the_kernels_load_waits_for_them_and_exits_cleanly():
    """A short program (a compressor built, nothing trained) whose interpreter finalizes while
    the daemon thread is still inside numba's loader must not be aborted: the exit waits for
    the load. The checker, registered first, runs after warm's own exit hook (LIFO)."""
    warm.wait(600)  # this process fills the cache if the session has not
    probe = ("import atexit; from gradientflow.kernels import warm; "
             "atexit.register(lambda: print('ready' if warm.ready() else 'loading')); "
             "warm.start()")
    for _ in range(3):
        run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
        assert run.stdout.split() == ["ready"], run.stdout
