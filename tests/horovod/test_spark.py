"""gradientflow.spark.run on real Spark in local mode (master local[2]): 2 ranks as Spark tasks.

Skips where pyspark is not installed (the `spark` extra) or Java is missing. Slow: the JVM,
Spark's Python workers and one torchrun per task all start here.
"""
from __future__ import annotations

import os
import shutil
import sys

import pytest

pytest.importorskip("pyspark", reason="pyspark is not installed (pip install "
                                      "'gradientflow[spark]')")
if shutil.which("java") is None:
    pytest.skip("Spark needs Java (17) on the PATH", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _make_train():
    """The training function, made here so that cloudpickle ships it by value to Spark (the
    test module is not importable on the Spark side)."""

    def _train(steps):
        """A Horovod-style training function: fit y = x @ w on each rank's own data."""
        import torch
        import torch.distributed as dist

        import gradientflow.horovod as hvd

        hvd.init()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        g = torch.Generator().manual_seed(hvd.rank())
        x = torch.randn(64, 4, generator=g)
        y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return {"rank": hvd.rank(), "size": hvd.size(), "backend": dist.get_backend(),
                "losses": losses, "weight": model.weight.detach().flatten().tolist()}

    return _train


@pytest.fixture(scope="module")
def spark():
    from pyspark.sql import SparkSession

    mp = pytest.MonkeyPatch()
    # Spark's Python workers must run this interpreter (torch, gradientflow) on loopback.
    mp.setenv("PYSPARK_PYTHON", sys.executable)
    mp.setenv("SPARK_LOCAL_IP", "127.0.0.1")
    mp.setenv("PYTHONPATH", os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    session = (SparkSession.builder.master("local[2]").appName("gradientflow-spark-test")
               .config("spark.ui.enabled", "false").getOrCreate())
    yield session
    session.stop()
    mp.undo()


@pytest.mark.slow
def test_spark_run_trains_on_two_spark_tasks(spark):
    import gradientflow.spark

    results = gradientflow.spark.run(_make_train(), args=(30,), num_proc=2, verbose=0)
    assert [r["rank"] for r in results] == [0, 1], results
    for r in results:
        assert r["size"] == 2 and r["backend"] == "gradientflow", r
        assert r["losses"][-1] < 0.01 * r["losses"][0], f"rank {r['rank']} did not train: {r}"
    assert results[0]["weight"] == results[1]["weight"], "ranks ended with different weights"


def test_spark_run_refuses_bad_num_proc(spark):
    import gradientflow.spark

    with pytest.raises(ValueError, match="num_proc=0 must be an integer >= 1"):
        gradientflow.spark.run(_make_train(), num_proc=0)
