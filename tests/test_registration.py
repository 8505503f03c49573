"""Registration: the entry point, idempotence, configuration errors."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from harness import autoloads_backends, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ENTRY_POINT_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    assert "gradientflow" not in sys.modules
    rank = int(sys.argv[1])
    dist.init_process_group("gradientflow", init_method="tcp://127.0.0.1:" + sys.argv[2],
                            rank=rank, world_size=2)
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    assert t.tolist() == [3.0] * 4, t
    sub = dist.new_group([0, 1], backend="gradientflow")
    u = torch.ones(2)
    dist.all_reduce(u, group=sub)
    assert u.tolist() == [2.0, 2.0], u
    print("backend", dist.get_backend(), "ok")
    dist.destroy_process_group()
""")


@pytest.mark.skipif(not autoloads_backends(), reason="torch < 2.14 loads no backend entry points")
def test_entry_point_in_a_script_that_never_imports_gradientflow(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(ENTRY_POINT_SCRIPT)
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADIENTFLOW_")}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = []
    for r, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"rank {r} hung")
        outs.append(out)
        assert p.returncode == 0, f"rank {r} failed:\n{out}"
    assert all("backend gradientflow ok" in o for o in outs), outs


def test_registrar_is_idempotent_and_never_raises():
    code = textwrap.dedent("""
        import torch.distributed as dist
        from gradientflow._registrar import register
        import gradientflow
        before = dict(dist.Backend._plugins)
        register(); register()
        assert dist.Backend._plugins == before
        assert "GRADIENTFLOW" in dist.Backend._plugins
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_config_parses_sizes_and_refuses_bad_values():
    from gradientflow.config import Config, parse_size

    assert parse_size("64MB") == 64 * 10**6
    assert parse_size("4MiB") == 4 * 2**20
    assert parse_size(0) == 0
    cfg = Config.resolve({}, environ={"GRADIENTFLOW_FUSION_THRESHOLD": "1KB"})
    assert cfg.fusion_threshold == 1000
    assert Config.resolve({"fusion_threshold": 5}, environ={
        "GRADIENTFLOW_FUSION_THRESHOLD": "1KB"}).fusion_threshold == 5
    for env, needle in [
        ({"GRADIENTFLOW_FUSION_THRESHOLD": "lots"}, "GRADIENTFLOW_FUSION_THRESHOLD"),
        ({"GRADIENTFLOW_FUSION_THRESHOLD": "-4"}, "GRADIENTFLOW_FUSION_THRESHOLD"),
        ({"GRADIENTFLOW_CYCLE_TIME_MS": "-1"}, "valid range"),
        ({"GRADIENTFLOW_DEBUG": "maybe"}, "boolean"),
        ({"GRADIENTFLOW_SOLO_CHANNEL": "sometimes"}, "GRADIENTFLOW_SOLO_CHANNEL"),
        ({"GRADIENTFLOW_FUSION_TRESHOLD": "1"}, "unknown environment variable"),
    ]:
        with pytest.raises(ValueError, match=needle):
            Config.resolve({}, environ=env)
    with pytest.raises(ValueError, match="unknown gradientflow option"):
        Config.resolve({"fusion": 1}, environ={})


def bad_env_at_init(rank, world):
    return "unreachable"


def test_invalid_environment_fails_init_clearly(pools):
    from harness import RankFailure

    with pytest.raises(RankFailure, match="GRADIENTFLOW_FUSION_THRESHOLD"):
        pools(2).run(bad_env_at_init, env={"GRADIENTFLOW_FUSION_THRESHOLD": "huge"})


@pytest.mark.timeout(300)
def test_pip_install_keeps_the_supported_torch_it_finds(tmp_path):
    """`pip install gradientflow` where a supported torch is installed installs no torch."""
    import json

    import torch

    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "-q",
                           "--report", str(report), ROOT],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = [item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]]
    assert "gradientflow" in names and "torch" not in names, (torch.__version__, names)
