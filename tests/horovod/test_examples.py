"""The Horovod-style examples on 2 ranks (dense and Compression.fp16), and gradientflow-run.

The examples run inside the warm rank pool (runpy, as `python script.py` would, with hvd.init()
adopting the pool's group), so four runs cost seconds; one run goes through the real launcher,
`python -m gradientflow.run -np 2 python ...`, end to end.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples", "horovod")
MNIST = os.path.join(EXAMPLES, "pytorch_mnist.py")
BENCH = os.path.join(EXAMPLES, "pytorch_synthetic_benchmark.py")
BENCH_ARGS = ["--model", "resnet18", "--image-size", "32", "--batch-size", "4",
              "--num-warmup-batches", "1", "--num-batches-per-iter", "2", "--num-iters", "2"]


def run_example(rank, world, path, argv):
    """Rank body: run an example script as __main__; return what it printed."""
    import contextlib
    import io
    import runpy

    out = io.StringIO()
    saved = sys.argv
    sys.argv = [path, *argv]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
    finally:
        sys.argv = saved
    return out.getvalue()


def _accuracy(text: str) -> float:
    found = re.findall(r"final accuracy ([0-9.]+)", text)
    assert found, f"no final accuracy in:\n{text}"
    return float(found[-1])


@pytest.mark.parametrize("fp16", [False, True], ids=["dense", "fp16"])
def test_mnist_example_two_ranks(pools, fp16):
    argv = ["--epochs", "3"] + (["--fp16-allreduce"] if fp16 else [])
    outs = pools(2).run(run_example, MNIST, argv, timeout=240)
    assert "compression " + ("fp16" if fp16 else "none") in outs[0]
    assert outs[1] == "", f"rank 1 printed (rank-0 output only): {outs[1]!r}"
    assert _accuracy(outs[0]) > 0.6, outs[0]


@pytest.mark.parametrize("fp16", [False, True], ids=["dense", "fp16"])
def test_synthetic_benchmark_two_ranks(pools, fp16):
    # The oldest-torch CI venv has no torchvision: the one built for torch 2.13 on this
    # machine's disk is a CUDA build, whose operators do not load with a CPU torch.
    pytest.importorskip("torchvision")
    argv = BENCH_ARGS + (["--fp16-allreduce"] if fp16 else [])
    outs = pools(2).run(run_example, BENCH, argv, timeout=240)
    assert "Number of CPUs: 2" in outs[0] and outs[1] == ""
    assert "Compression: " + ("fp16" if fp16 else "none") in outs[0]
    rate = re.search(r"Total img/sec on 2 CPU\(s\): ([0-9.]+)", outs[0])
    assert rate and float(rate.group(1)) > 0, outs[0]


def test_launcher_runs_mnist_fp16_end_to_end():
    cmd = [sys.executable, "-m", "gradientflow.run", "-np", "2", "--start-timeout", "120",
           "--cycle-time-ms", "2", "python", MNIST, "--epochs", "3", "--fp16-allreduce"]
    # PYTHONFAULTHANDLER: a rank that aborts (e.g. at exit) prints every thread's stack
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               PYTHONFAULTHANDLER="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"gradientflow-run failed:\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.count("Training on 2 process(es)") == 1, proc.stdout
    assert _accuracy(proc.stdout) > 0.6, proc.stdout


def test_launcher_command_lines():
    from gradientflow.run import build_parser, torchrun_command, _env

    def cmd(*argv):
        return torchrun_command(build_parser().parse_args(list(argv)))

    c = cmd("-np", "3", "python", "train.py", "--lr", "0.1")
    i = c.index("--nproc-per-node")
    assert c[i + 1] == "3" and c[-3:] == ["train.py", "--lr", "0.1"]
    assert "--no-python" not in c
    assert cmd("-np", "2", "train.py")[-1] == "train.py"
    assert cmd("-np", "2", "python3", "-m", "pkg.mod", "x")[-3:] == ["--module", "pkg.mod", "x"]
    assert cmd("-np", "2", "./run.sh")[-2:] == ["--no-python", "./run.sh"]
    assert cmd("-np", "2", "-H", "localhost:2", "t.py")[-1] == "t.py"
    c = cmd("-np", "2", "--output-filename", "logs", "--start-timeout", "30", "t.py")
    assert c[c.index("--log-dir") + 1] == "logs" and "join_timeout=30" in c
    for argv, text in [(("-np", "4", "-H", "localhost:2", "t.py"), "more than the 2 slots"),
                       (("-np", "2", "-H", "elsewhere:2", "t.py"), "is not this host"),
                       (("-np", "2", "--mpi", "t.py"), "--mpi is not offered"),
                       (("-np", "2"), "no command given")]:
        with pytest.raises(SystemExit, match=text):
            cmd(*argv)
    env = _env(build_parser().parse_args(["-np", "2", "--fusion-threshold-mb", "64",
                                          "--cycle-time-ms", "5", "--timeline-filename",
                                          "tl.json", "t.py"]))
    assert env == {"GRADIENTFLOW_FUSION_THRESHOLD": str(64 << 20),
                   "GRADIENTFLOW_CYCLE_TIME_MS": "5.0", "GRADIENTFLOW_TIMELINE": "tl.json"}
