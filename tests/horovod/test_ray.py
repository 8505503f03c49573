"""Ray Train's TorchTrainer with TorchConfig(backend="gradientflow"): the example, 2 workers.

Skips where ray[train] is not installed (the `ray` extra). Slow: a local Ray cluster starts.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("ray.train.torch", reason="ray[train] is not installed (pip install "
                                              "'gradientflow[ray]')")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "horovod", "ray_torch_trainer.py")


@pytest.mark.slow
def test_ray_torch_trainer_example_trains_over_gradientflow():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               RAY_DEDUP_LOGS="0")
    proc = subprocess.run([sys.executable, EXAMPLE, "--num-workers", "2", "--epochs", "3"],
                          capture_output=True, text=True, timeout=540, env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the Ray example failed:\n{out[-6000:]}"
    found = re.findall(r"final loss ([0-9.]+) on 2 workers, backend gradientflow", out)
    # Ray may echo a worker's line on both streams: one distinct line, from rank 0 only.
    assert len(set(found)) == 1, f"expected rank 0's result line:\n{out[-6000:]}"
    assert float(found[0]) < 0.05, out[-3000:]
