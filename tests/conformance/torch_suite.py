"""Run PyTorch's own distributed test suite with gradientflow standing in for gloo.

torch.testing._internal.distributed.distributed_test.DistributedTest is the suite that
test/distributed/test_distributed_spawn.py runs per backend. Its skip decisions read the
BACKEND environment variable at import, so the suite is imported as gloo's (BACKEND=gloo, the
same tests run and skip as on gloo), and every process group its ranks create with "gloo" is
created with the backend under test instead. Each test spawns WORLD_SIZE rank processes.

    python tests/conformance/torch_suite.py --backend gradientflow [--tests a,b] [--out DIR]
    python tests/conformance/torch_suite.py --compare            # gloo and gradientflow
    python tests/conformance/torch_suite.py --compare --gloo-result DIR/torch_suite_gloo.json

Writes DIR/torch_suite_<backend>.json (outcome per test) and prints the counts; --compare
runs gradientflow only on the tests that passed on gloo (each test spawns its ranks, skipped
ones too: about two thirds of the suite skips on gloo) and prints those that do not pass
there. --gloo-result takes gloo's outcomes from an earlier run instead of running it again.
A run stopped with Ctrl-C still writes the outcomes of the tests it finished.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
_STANDIN = "GF_TORCH_SUITE_BACKEND"  # read by this module in the spawned ranks too

# The tests the issue found failing on gradientflow, and a few that must keep passing: the
# bounded subset CI runs (tests/conformance/test_torch_suite.py).
SUBSET = (
    "test_isend", "test_irecv", "test_isend_autograd_profiler", "test_isend_torch_profiler",
    "test_send_recv_any_source", "test_send_recv_any_source_autograd_profiler",
    "test_send_recv_any_source_torch_profiler",
    "test_monitored_barrier_gloo", "test_monitored_barrier_gloo_subgroup",
    "test_monitored_barrier_wait_all_ranks", "test_monitored_barrier_failure_order",
    "test_monitored_barrier_gloo_rank_0_timeout",
    "test_sparse_all_reduce_sum", "test_get_backend", "test_ddp_logging_data_cpu",
    "test_all_reduce_sum", "test_broadcast", "test_send_recv", "test_barrier",
)


def _install_standin() -> None:
    """In a rank: process groups asked for as "gloo" are created with the backend under test."""
    backend = os.environ.get(_STANDIN, "gloo")
    if backend == "gloo":
        return
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    def swap(value):
        return backend if isinstance(value, str) and value.lower() == "gloo" else value

    def wrap(fn, pos):
        def inner(*args, **kwargs):
            if "backend" in kwargs:
                kwargs["backend"] = swap(kwargs["backend"])
            elif len(args) > pos:
                args = (*args[:pos], swap(args[pos]), *args[pos + 1:])
            return fn(*args, **kwargs)

        inner.__wrapped__ = fn
        return inner

    for mod in (dist, c10d):
        mod.init_process_group = wrap(c10d.init_process_group, 0)
        mod.new_group = wrap(c10d.new_group, 2)
    import gradientflow  # noqa: F401 - registers the backend


if __name__ != "__main__" and os.environ.get(_STANDIN):
    # Imported by pytest in the runner's child process, and by every spawned rank (both carry
    # _STANDIN); a test that imports this module for run() and SUBSET must not get the suite's
    # environment (WORLD_SIZE=3 would leak into every later test of its process).
    os.environ.setdefault("BACKEND", "gloo")
    os.environ.setdefault("WORLD_SIZE", "3")
    os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="gf_torch_suite_"))
    from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
        DistributedTest, TestDistBackend)

    _install_standin()

    class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
        """As test_distributed_spawn.py builds it: each test spawns its ranks."""

        def setUp(self):
            super().setUp()
            self._spawn_processes()


def _outcomes(junit: str) -> dict[str, str]:
    out: dict[str, str] = {}
    if not os.path.exists(junit):
        return out
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name")
        if name is None:  # the placeholder an interrupted run (Ctrl-C) leaves: no outcome
            continue
        kinds = {child.tag for child in case}
        out[name] = ("failed" if kinds & {"failure", "error"} else
                     "skipped" if "skipped" in kinds else "passed")
    return out


def run(backend: str, tests: list[str] | None, timeout_s: float, out_dir: str) -> dict:
    """Run the suite (or `tests`) on `backend` in a child pytest; return outcome per test."""
    os.makedirs(out_dir, exist_ok=True)
    junit = os.path.join(out_dir, f"torch_suite_{backend}.xml")
    env = dict(os.environ, **{_STANDIN: backend, "BACKEND": "gloo", "WORLD_SIZE": "3"})
    env["PYTHONPATH"] = os.pathsep.join([_ROOT, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           f"--rootdir={_HERE}", "-o", "addopts=", f"--junitxml={junit}",
           f"--timeout={int(timeout_s)}", os.path.abspath(__file__)]
    if tests:  # exact node ids (-k would match test_x_cuda too)
        cmd = cmd[:-1] + [f"{os.path.abspath(__file__)}::TestDistBackendWithSpawn::{t}"
                          for t in tests]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=_HERE, capture_output=True, text=True)
    outcomes = _outcomes(junit)
    result = {"backend": backend, "seconds": round(time.monotonic() - t0, 1),
              "returncode": proc.returncode, "outcomes": outcomes,
              "counts": {k: sum(v == k for v in outcomes.values())
                         for k in ("passed", "failed", "skipped")},
              "tail": proc.stdout[-4000:]}
    with open(os.path.join(out_dir, f"torch_suite_{backend}.json"), "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    return result


def main(argv=None) -> int:
    """Command line: run one backend, or both and compare."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="gradientflow")
    ap.add_argument("--compare", action="store_true", help="run gloo and gradientflow")
    ap.add_argument("--tests", default="", help="comma-separated test names (default: all)")
    ap.add_argument("--subset", action="store_true", help="the bounded subset CI runs")
    ap.add_argument("--gloo-result", default="", help="with --compare: gloo's JSON from an "
                    "earlier run (not run again)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per test")
    ap.add_argument("--out", default=os.path.join(_ROOT, "benchmarks", "results",
                                                  "torch_suite"))
    args = ap.parse_args(argv)
    tests = list(SUBSET) if args.subset else [t for t in args.tests.split(",") if t] or None
    if not args.compare:
        results = {args.backend: run(args.backend, tests, args.timeout, args.out)}
    elif args.gloo_result:
        with open(args.gloo_result) as f:
            results = {"gloo": json.load(f)}
    else:
        results = {"gloo": run("gloo", tests, args.timeout, args.out)}
    if args.compare:
        on_gloo = sorted(t for t, v in results["gloo"]["outcomes"].items() if v == "passed")
        if not on_gloo:  # run() with no tests would run the whole suite
            print("no test passed on gloo: nothing to compare")
            return 1
        results["gradientflow"] = run("gradientflow", on_gloo, args.timeout, args.out)
    for b, r in results.items():
        print(f"{b}: {r['counts']} in {r['seconds']} s")
    if args.compare:
        gf = results["gradientflow"]["outcomes"]
        lost = [t for t in on_gloo if gf.get(t) != "passed"]
        print(f"pass on gloo: {len(on_gloo)}; also on gradientflow: {len(on_gloo) - len(lost)}")
        for t in lost:
            print(f"  not on gradientflow: {t} ({gf.get(t)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
