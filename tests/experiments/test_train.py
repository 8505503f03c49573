"""experiments/imagenet/train.py: bad input refused before init, a tiny run works, exact resume."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "imagenet" / "train.py"
TIMEOUT = 240  # seconds for any one subprocess: a hang fails the test instead of the suite


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


train = _load("gf_experiments_train", SCRIPT)
prepare = _load("gf_experiments_prepare", SCRIPT.parent / "prepare.py")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def _gradientflow_ready() -> bool:
    try:
        from gradientflow.compression import CompressionConfig  # noqa: F401
        from gradientflow.hooks import register  # noqa: F401
        import gradientflow.backend.backend  # noqa: F401
        return True
    except ImportError:
        return False


# ---- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, words", [
    (["/no/such/imagenet"], "data directory"),
    (["--dummy", "-a", "no_such_net"], "unknown arch"),
    (["--dummy", "--density", "0"], "--density"),
    (["--dummy", "--density", "1.5"], "--density"),
    (["--dummy", "--chunk-size", "0"], "--chunk-size"),
    (["--dummy", "--compression", "csc", "--min-numel", "-1"], "min_numel"),
    (["--dummy", "--fusion-threshold", "lots"], "--fusion-threshold"),
    (["--dummy", "--fusion-threshold", "64MB", "--dist-backend", "gloo"], "gradientflow option"),
    (["--dummy", "--warmup", "0.5,2"], "--warmup"),
    (["--dummy", "--resume", "/no/such/checkpoint.pth.tar"], "--resume"),
    (["--dummy", "--no-such-flag"], "unrecognized"),
])
def test_bad_input_is_one_line_and_exit_2_before_init(argv, words, monkeypatch, capsys):
    def no_init(*args, **kwargs):
        raise AssertionError("init_process_group was called for bad input")

    monkeypatch.setattr(train.dist, "init_process_group", no_init)
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train.py: error:") and words in err[0], err


def test_bad_input_from_the_command_line_exits_nonzero_with_one_line():
    proc = subprocess.run([sys.executable, str(SCRIPT), "/no/such/imagenet", "-a", "resnet18"],
                          capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "data directory" in proc.stderr, proc.stderr


def test_config_derives_per_rank_batch_and_scaled_lr():
    cfg = train.resolve(
        train.parse_args(["--dummy", "-b", "512", "--lr", "0.1"]), env={"WORLD_SIZE": "4"}
    )
    assert cfg.per_rank_batch == 128 and cfg.peak_lr == pytest.approx(0.2)
    with pytest.raises(train.ConfigError, match="multiple of the world size"):
        train.resolve(train.parse_args(["--dummy", "-b", "6"]), env={"WORLD_SIZE": "4"})


def test_lr_schedule_warms_up_then_steps():
    cfg = train.resolve(
        train.parse_args(["--dummy", "--lr-warmup-epochs", "2", "--lr-steps", "3,5"]), env={}
    )
    peak = cfg.peak_lr
    assert train.learning_rate(cfg, 1.0) == pytest.approx(peak / 2)
    assert train.learning_rate(cfg, 2.5) == pytest.approx(peak)
    assert train.learning_rate(cfg, 4.0) == pytest.approx(peak * 0.1)
    assert train.learning_rate(cfg, 6.0) == pytest.approx(peak * 0.01)


def test_backend_options_go_to_init_as_pg_options_not_the_environment(monkeypatch):
    """--fusion-threshold is parsed by gradientflow's own size parser and handed to
    init_process_group; train.py writes nothing into os.environ."""
    calls = []
    monkeypatch.setattr(train.dist, "init_process_group", lambda **kw: calls.append(kw))
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    cfg = train.resolve(train.parse_args(["--dummy", "--fusion-threshold", "64MiB"]), env={})
    before = dict(os.environ)
    train.init_distributed(cfg)
    assert dict(os.environ) == before
    (kw,) = calls
    assert kw["pg_options"] == {"fusion_threshold": 64 * 2**20}
    assert kw["backend"] == "gradientflow" and kw["init_method"].startswith("tcp://127.0.0.1:")
    plain = train.resolve(train.parse_args(["--dummy"]), env={})
    train.init_distributed(plain)
    assert "pg_options" not in calls[-1]  # unset: the backend's defaults and GRADIENTFLOW_* apply


def test_unset_csc_flags_leave_the_library_defaults():
    from gradientflow.compression import CompressionConfig

    cfg = train.resolve(train.parse_args(["--dummy", "--compression", "csc"]), env={})
    default = CompressionConfig(method="csc")
    comp = cfg.compression_config
    for field in ("warmup_densities", "warmup_unit", "warmup_period", "momentum_correction",
                  "chunk_size", "momentum", "clip_norm", "min_numel"):
        assert getattr(comp, field) == getattr(default, field), field
    on = train.resolve(train.parse_args(["--dummy", "--compression", "csc", "--momentum-correction",
                                         "--chunk-size", "256", "--clip-norm", "2",
                                         "--min-numel", "1024"]), env={})
    assert on.compression_config.momentum_correction and on.compression_config.chunk_size == 256
    assert on.compression_config.clip_norm == 2.0 and on.compression_config.min_numel == 1024
    off = train.resolve(train.parse_args(["--dummy", "--compression", "csc",
                                          "--no-momentum-correction"]), env={})
    assert not off.compression_config.momentum_correction


def test_alexnet_bn_is_an_arch_with_batch_norm_after_every_hidden_layer():
    cfg = train.resolve(train.parse_args(["--dummy", "-a", "alexnet_bn", "--num-classes", "7"]),
                        env={})
    model = train.build_model(cfg).eval()
    bn = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d)
    norms = [m for m in model.modules() if isinstance(m, bn)]
    linear = [m for m in model.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    assert len(norms) == 7 and len(linear) == 8  # 5 conv + 2 hidden FC normalised, not the head
    with torch.no_grad():
        assert model(torch.randn(2, 3, 64, 64)).shape == (2, 7)
    plain = train.build_model(train.resolve(
        train.parse_args(["--dummy", "-a", "alexnet", "--num-classes", "7"]), env={}))
    # torchvision's layer shapes: the same weight matrices (biases give way to BN's shift).
    assert (sorted(tuple(p.shape) for p in model.parameters() if p.ndim > 1)
            == sorted(tuple(p.shape) for p in plain.parameters() if p.ndim > 1))



def test_the_noop_hook_returns_each_ranks_gradient_untouched():
    class Bucket:
        def __init__(self, t):
            self.t = t

        def buffer(self):
            return self.t

    grad = torch.arange(5.0)
    fut = train.NoCommunication.hook(None, Bucket(grad))
    assert fut.done() and fut.value() is grad and torch.equal(grad, torch.arange(5.0))
    cfg = train.resolve(train.parse_args(["--dummy", "--compression", "noop"]), env={})
    assert cfg.compression == "noop" and cfg.compression_config is None

# ---- a tiny run ----------------------------------------------------------------------------------
def test_tiny_dummy_run_on_one_process(tmp_path):
    backend, comp = ("gradientflow", "csc") if _gradientflow_ready() else ("gloo", "none")
    log = tmp_path / "log.jsonl"
    cmd = [
        sys.executable, str(SCRIPT), "--dummy", "-a", "resnet18", "--image-size", "32",
        "--num-classes", "10", "-b", "4", "--steps-per-epoch", "2", "--epochs", "1", "-j", "1",
        "--dist-backend", backend, "--compression", comp, "--density", "0.01",
        "--warmup", "none", "--json-log", str(log), "--checkpoint-dir", str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    (record,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert (
        record["steps"] == 2
        and record["images_per_s"] > 0
        and 0 < record["wire_bytes"] <= record["dense_bytes"]
    )
    assert (tmp_path / "checkpoint.pth.tar").is_file() and (
        tmp_path / "checkpoint.pth.tar.rank0"
    ).is_file()


# ---- resume equivalence --------------------------------------------------------------------------
def _torchrun(args, tmp_path, name):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(SCRIPT), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    (tmp_path / f"{name}.out").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _params(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)["state_dict"]


@pytest.mark.slow
def test_stop_and_resume_gives_the_parameters_of_an_uninterrupted_run(tmp_path):
    """2 ranks, CSC (residuals matter): 2 epochs straight == 1 epoch, stop, resume 1 more."""
    data = prepare.prepare(tmp_path / "digits", size=16, limit=48)
    backend, comp = ("gradientflow", "csc") if _gradientflow_ready() else ("gloo", "none")
    common = [
        str(data), "-a", "resnet18", "--image-size", "16", "--num-classes", "10",
        "--augment", "none", "-b", "16", "--lr", "0.05", "--lr-base-batch", "16", "-j", "0",
        "--seed", "3", "--dist-backend", backend, "--compression", comp, "--density", "0.01",
        "--warmup", "0.25", "--bucket-cap-mb", "5",
    ]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    _torchrun(common + ["--epochs", "2", "--checkpoint-dir", str(straight)], tmp_path, "straight")
    _torchrun(common + ["--epochs", "1", "--checkpoint-dir", str(stopped)], tmp_path, "first")
    if (
        comp == "csc"
    ):  # the shards hold residuals: they must be non-zero for the test to mean anything
        shard = torch.load(stopped / "checkpoint.pth.tar.rank1", weights_only=False)["compressor"]
        assert any(torch.is_tensor(v) and v.abs().sum() > 0 for v in _tensors(shard)), (
            "no residual in the shard"
        )
    _torchrun(common + ["--epochs", "2", "--resume", str(stopped / "checkpoint.pth.tar"),
                        "--checkpoint-dir", str(stopped)], tmp_path, "resumed")
    a, b = _params(straight / "checkpoint.pth.tar"), _params(stopped / "checkpoint.pth.tar")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def _tensors(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def test_compression_without_gradientflow_hooks_says_it_is_waiting(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gradientflow.hooks", None)  # import now raises ImportError
    assert train.main(["--dummy", "--compression", "csc"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "waiting on gradientflow.hooks" in err[0], err


def test_dataloader_workers_never_fork():
    cfg = train.resolve(train.parse_args(["--dummy", "-j", "2", "-b", "4"]), env={})
    loader = train.make_loader(list(range(8)), cfg, None, torch.device("cpu"))
    assert loader.multiprocessing_context.get_start_method() in ("forkserver", "spawn")
