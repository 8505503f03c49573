"""The CLI a script checks: one JSON object with speedup and epoch_time_s, every method."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradientflow.simulate.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"speedup", "epoch_time_s", "step_s", "compute_s", "comm_s", "exposed_comm_s",
        "scaling_efficiency", "throughput", "train_time_s", "wire_bytes", "messages",
        "cluster_config", "method_config"}


def test_issue_command_prints_one_json_object():
    cmd = [sys.executable, "-m", "gradientflow.simulate", "--model", "resnet50", "--gpus", "512",
           "--gpus-per-node", "8", "--gbps", "56", "--method", "gradientflow", "--json"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, out.stdout
    obj = json.loads(lines[0])
    assert KEYS <= obj.keys()
    assert obj["gpus"] == 512 and obj["model"] == "resnet50" and obj["method"] == "gradientflow"
    assert 1 < obj["speedup"] <= 512
    assert obj["epoch_time_s"] > 0 and obj["step_s"] >= obj["compute_s"]


@pytest.mark.parametrize("method", ["ring", "hierarchical", "reduction_server", "gradientflow",
                                    "gradientflow-engine",
                                    "gradientflow-paper", "horovod"])
def test_every_method_is_accepted(method, capsys):
    assert main(["--model", "alexnet", "--gpus", "64", "--method", method, "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["method"] == method and 1 < obj["speedup"] <= 64
    # strict JSON: no NaN or Infinity (cycle_ms=inf is written as "inf")
    json.loads(json.dumps(obj), parse_constant=lambda c: pytest.fail(f"non-finite {c}"))


def test_overrides_reach_the_model(capsys):
    base = ["--model", "resnet50", "--gpus", "64", "--json", "--method", "ring"]
    main(base)
    plain = json.loads(capsys.readouterr().out)
    main(base + ["--fp16", "on", "--csc-density", "0.01", "--fusion-mb", "64"])
    tuned = json.loads(capsys.readouterr().out)
    assert tuned["method_config"]["csc_density"] == 0.01
    assert tuned["wire_bytes"] < plain["wire_bytes"] / 50
    main(base + ["--dataset-size", "1000", "--batch", "10"])
    small = json.loads(capsys.readouterr().out)
    assert small["batch"] == 10
    assert small["epoch_time_s"] == pytest.approx(1000 / (64 * 10) * small["step_s"])


def test_sweep_gives_one_result_per_count(capsys):
    assert main(["--model", "bert-base", "--sweep", "1,8,64", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert [r["gpus"] for r in obj["results"]] == [1, 8, 64]
    assert obj["results"][0]["speedup"] == pytest.approx(1.0)


def test_bad_input_is_a_clear_error(capsys):
    assert main(["--gpus", "0"]) == 2
    assert "gpus=0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--csc-density", "2"])


def test_a_profile_file_is_a_model(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    from gradientflow.simulate.profile import measure_module

    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    path = tmp_path / "mlp.json"
    path.write_text(json.dumps(measure_module(net, torch.randn(16, 64), "mlp", reps=1)))
    assert main(["--model", str(path), "--gpus", "16", "--json"]) == 2  # no workload given
    assert "throughput" in capsys.readouterr().err
    assert main(["--model", str(path), "--gpus", "16", "--batch", "16", "--throughput", "1e4",
                 "--dataset-size", "16000", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["model"] == "mlp" and obj["batch"] == 16 and 1 < obj["speedup"] <= 16
    assert obj["epoch_time_s"] == pytest.approx(16000 / (16 * 16) * obj["step_s"])
