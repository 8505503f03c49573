"""Run PyTorch's own distributed test suite with gradientflow standing in for gloo.

torch.testing._internal.distributed.distributed_test.DistributedTest is the suite that
test/distributed/test_distributed_spawn.py runs per backend. Its skip decisions read the
BACKEND environment variable at import, so the suite is imported as gloo's (BACKEND=gloo, the
same tests run and skip as on gloo), and every process group its ranks create with "gloo" is
created with the backend under test instead. Each test spawns WORLD_SIZE rank processes.

    python tests/conformance/torch_suite.py --backend gradientflow [--tests a,b] [--out DIR]
    python tests/conformance/torch_suite.py --compare [--resume]   # gloo, then gradientflow
    python tests/conformance/torch_suite.py --table                 # DIR/torch_suite.md only

With --fork each test forks its ranks from the test process, which has imported torch and
the suite already, instead of spawning them as test_distributed_spawn.py does: a spawned rank
imports both again, which took 1 to 4 minutes a test (skipped ones too) on a loaded 2-core
host, a forked one seconds. Every test, and both backends, run the same way.

Runs the tests ten at a time, each batch in a child pytest, and after each batch writes
DIR/torch_suite_<backend>.json (outcome, seconds and first message line per test), so a run
that is stopped keeps what it finished and --resume goes on from there. --compare runs the
whole list on both backends (each test spawns its ranks, skipped ones too: most of the suite
skips itself on CPU) and writes DIR/torch_suite.md, one row per test with the reason where the
backends differ.
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
_SELF = os.path.abspath(__file__)
_TIMED_OUT = "Failed: Timeout"  # pytest-timeout's message
_FORK = "GF_TORCH_SUITE_FORK"  # "1": ranks are forked from the test process, not spawned
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
            if os.environ.get(_FORK) == "1":  # children inherit the imported suite: seconds
                import torch.multiprocessing

                self._start_processes(torch.multiprocessing.get_context("fork").Process)
            else:
                self._spawn_processes()


def _outcomes(junit: str) -> dict[str, dict]:
    """Outcome, seconds and first message line of each test case in a junit file."""
    out: dict[str, dict] = {}
    if not os.path.exists(junit):
        return out
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name")
        if name is None:  # the placeholder an interrupted run (Ctrl-C) leaves: no outcome
            continue
        found = {child.tag: child for child in case}
        kind = ("failed" if found.keys() & {"failure", "error"} else
                "skipped" if "skipped" in found else "passed")
        detail = next((found[k] for k in ("failure", "error", "skipped") if k in found), None)
        message = (detail.get("message") or "") if detail is not None else ""
        out[name] = {"outcome": kind, "seconds": round(float(case.get("time") or 0), 1),
                     "message": message.strip().splitlines()[0][:300] if message.strip() else ""}
    return out


def collect() -> list[str]:
    """Every test name of the suite, in its order (pytest --collect-only)."""
    proc = subprocess.run(_pytest_cmd(None) + ["--collect-only", _SELF], env=_env("gloo"),
                          cwd=_HERE, capture_output=True, text=True)
    names = [line.rsplit("::", 1)[1] for line in proc.stdout.splitlines() if "::" in line]
    if not names:
        raise RuntimeError(f"collecting the suite failed:\n{proc.stdout[-2000:]}"
                           f"{proc.stderr[-2000:]}")
    return names


def _env(backend: str) -> dict:
    env = dict(os.environ, **{_STANDIN: backend, "BACKEND": "gloo", "WORLD_SIZE": "3"})
    env["PYTHONPATH"] = os.pathsep.join([_ROOT, env.get("PYTHONPATH", "")])
    return env


def _pytest_cmd(junit: str | None, timeout_s: float = 0) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           f"--rootdir={_HERE}", "-o", "addopts="]
    if junit:
        cmd.append(f"--junitxml={junit}")
    if timeout_s:
        cmd.append(f"--timeout={int(timeout_s)}")
    return cmd


def run(backend: str, tests: list[str] | None, timeout_s: float, out_dir: str,
        resume: bool = False, chunk: int = 10) -> dict:
    """Run the suite (or `tests`) on `backend`, `chunk` tests per child pytest; return the
    result (outcome, seconds and message per test), saved after every chunk.

    With `resume`, tests that already have an outcome in out_dir's JSON are not run again,
    unless it was a timeout.
    """
    import torch

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"torch_suite_{backend}.json")
    result = {"backend": backend, "torch": torch.__version__, "world_size": 3,
              "timeout_s": timeout_s, "seconds": 0.0, "tests": {},
              "ranks": "forked" if os.environ.get(_FORK) == "1" else "spawned"}
    if resume and os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
    done = result["tests"]
    # A timeout on a loaded host says nothing about the backend: resuming runs it again.
    todo = [t for t in (tests or collect())
            if t not in done or done[t]["message"].startswith(_TIMED_OUT)]
    junit = os.path.join(out_dir, f"torch_suite_{backend}.xml")
    for i in range(0, len(todo), chunk):
        batch = todo[i:i + chunk]
        cmd = _pytest_cmd(junit, timeout_s) + [f"{_SELF}::TestDistBackendWithSpawn::{t}"
                                               for t in batch]  # exact ids: -k matches more
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, env=_env(backend), cwd=_HERE, capture_output=True,
                                  text=True, timeout=len(batch) * (timeout_s + 60))
            tail = proc.stdout[-4000:]
        except subprocess.TimeoutExpired as exc:  # pytest-timeout did not end it
            tail = f"chunk killed after {exc.timeout:.0f} s"
        result["seconds"] = round(result["seconds"] + time.monotonic() - t0, 1)
        got = _outcomes(junit)
        for t in batch:
            result["tests"][t] = got.get(t, {"outcome": "failed", "seconds": 0.0,
                                             "message": tail.strip()[-300:]})
        result["counts"] = {k: sum(v["outcome"] == k for v in result["tests"].values())
                            for k in ("passed", "failed", "skipped")}
        with open(path, "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
        print(f"{backend}: {len(result['tests'])} tests, {result['counts']}", flush=True)
    return result


def _reasons() -> dict[str, str]:
    """Why each test that passes on gloo cannot pass here (tests/conformance/
    test_torch_suite.py keeps the list, beside the checks of what a user gets instead)."""
    sys.path.insert(0, _HERE)
    from test_torch_suite import CANNOT_PASS

    return CANNOT_PASS


def _cell(entry: dict, outcome: str) -> str:
    """The outcome, marked where it was merged from an earlier run (its message says so)."""
    return outcome + (" (earlier)" if entry.get("message", "").startswith("earlier run") else "")


def write_table(out_dir: str) -> str:
    """torch_suite.md in `out_dir`: each test's outcome on gloo and on gradientflow, with the
    reason where they differ; returns its path."""
    res = {}
    for b in ("gloo", "gradientflow"):
        with open(os.path.join(out_dir, f"torch_suite_{b}.json")) as f:
            res[b] = json.load(f)
    gloo, gf = res["gloo"]["tests"], res["gradientflow"]["tests"]
    reasons = _reasons()
    both = [t for t in gloo if gloo[t]["outcome"] == "passed" and
            gf.get(t, {}).get("outcome") == "passed"]
    lines = [
        "# PyTorch's DistributedTest on gloo and on gradientflow",
        "",
        "Written by `python tests/conformance/torch_suite.py --table` from the JSON files "
        f"beside it (torch {res['gloo']['torch']}, CPU, WORLD_SIZE 3, ranks "
        f"{res['gloo'].get('ranks', 'spawned')}, "
        f"{res['gloo']['timeout_s']:.0f} s per test). Their `note` says which runs they hold; "
        "\"(earlier)\" marks an outcome taken from an earlier run.",
        "",
        "| | passed | skipped | failed | not run | wall time |",
        "|---|---|---|---|---|---|",
    ]
    names = collect()  # the whole suite, in its order: tests neither run reached are rows too
    for b, r in res.items():
        c = r["counts"]
        lines.append(f"| {b} | {c['passed']} | {c['skipped']} | {c['failed']} | "
                     f"{len(names) - len(r['tests'])} | {r['seconds'] / 60:.0f} min |")
    lines += ["", f"Pass on both: {len(both)}.", "",
              "| test | gloo | gradientflow | s (gloo) | s (gradientflow) | where they differ |",
              "|---|---|---|---|---|---|"]
    for t in names:
        a, b = gloo.get(t, {}), gf.get(t, {})
        oa, ob = a.get("outcome", "not run"), b.get("outcome", "not run")
        why = ""
        if oa != ob and "not run" not in (oa, ob):
            why = reasons.get(t) or (b.get("message") or a.get("message") or "").replace(
                "|", "/")[:160]
        lines.append(f"| {t} | {_cell(a, oa)} | {_cell(b, ob)} | {a.get('seconds') or ''} | "
                     f"{b.get('seconds') or ''} | {why} |")
    path = os.path.join(out_dir, "torch_suite.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def main(argv=None) -> int:
    """Command line: run one backend, or both and compare; or write the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="gradientflow")
    ap.add_argument("--compare", action="store_true", help="run gloo and gradientflow")
    ap.add_argument("--tests", default="", help="comma-separated test names (default: all)")
    ap.add_argument("--subset", action="store_true", help="the bounded subset CI runs")
    ap.add_argument("--resume", action="store_true",
                    help="keep the outcomes already in DIR's JSON; run only the other tests")
    ap.add_argument("--table", action="store_true", help="only write DIR/torch_suite.md")
    ap.add_argument("--fork", action="store_true", help="fork each test's ranks from the test "
                    "process instead of spawning them (seconds instead of minutes a test on a "
                    "loaded 2-core host)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per test")
    ap.add_argument("--chunk", type=int, default=10, help="tests per child pytest (a run "
                    "stopped mid-batch loses that batch)")
    ap.add_argument("--out", default=os.path.join(_ROOT, "benchmarks", "results",
                                                  "torch_suite"))
    args = ap.parse_args(argv)
    if args.table:
        print(write_table(args.out))
        return 0
    if args.fork:
        os.environ[_FORK] = "1"  # read in the child pytest, which inherits the environment
    tests = list(SUBSET) if args.subset else [t for t in args.tests.split(",") if t] or None
    backends = ["gloo", "gradientflow"] if args.compare else [args.backend]
    results = {b: run(b, tests, args.timeout, args.out, args.resume, args.chunk)
               for b in backends}
    for b, r in results.items():
        print(f"{b}: {r['counts']} in {r['seconds']} s")
    if args.compare:
        print(write_table(args.out))
        gloo, gf = results["gloo"]["tests"], results["gradientflow"]["tests"]
        on_gloo = [t for t, v in gloo.items() if v["outcome"] == "passed"]
        lost = [t for t in on_gloo if gf.get(t, {}).get("outcome") != "passed"]
        print(f"pass on gloo: {len(on_gloo)}; also on gradientflow: {len(on_gloo) - len(lost)}")
        for t in lost:
            print(f"  not on gradientflow: {t} ({gf.get(t, {}).get('outcome')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
