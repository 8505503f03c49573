"""The restart scenario of train.py under torchrun --max-restarts, and how to read its logs.

Shared by tests/reliability/test_restart.py (run once) and benchmarks/soak.py (run many times
with random fault points): a test must not depend on a benchmark script, and both read the
lines train.py prints when it saves, resumes and injects a fault.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = Path(ROOT) / "experiments" / "imagenet" / "train.py"
_SAVED = re.compile(r"\[rank (\d+)\] checkpoint saved after epoch (\d+): compressor residuals "
                    r"(crc32 \w+ l1 (\S+))")
_RESUMED = re.compile(r"\[rank (\d+)\] resumed from \S+ at epoch (\d+): compressor residuals "
                      r"(crc32 \w+ l1 (\S+))")
_KILLED = re.compile(r"\[rank (\d+)\] fault injection: SIGKILL at step \d+ \(attempt 0, time "
                     r"([\d.]+)\)")


def prepare_digits(out: Path) -> Path:
    """The experiment's digits ImageFolder, 48 images per split at 16 px (3 steps of 16)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gf_soak_prepare", TRAIN.parent / "prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.prepare(out, size=16, limit=48)


def restart_command(data: Path, ckpt: Path, log_dir: Path, kill_at_step: int,
                    max_restarts: int = 1) -> list[str]:
    """torchrun, 2 ranks; train.py on the digits with CSC at 1% (so there are residuals),
    per-rank shards, --resume auto, two epochs of 3 steps; the last rank kills itself before
    global step `kill_at_step` in the first attempt (-1: no fault)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", str(max_restarts), "--log-dir", str(log_dir), "--redirects", "3",
            str(TRAIN), str(data), "-a", "resnet18", "--image-size", "16", "--num-classes", "10",
            "--augment", "none", "-b", "16", "--lr", "0.05", "--lr-base-batch", "16", "-j", "0",
            "--seed", "3", "--compression", "csc", "--density", "0.01", "--warmup", "none",
            "--bucket-cap-mb", "5", "--epochs", "2", "--checkpoint-dir", str(ckpt),
            "--resume", "auto", "--fault-kill-at-step", str(kill_at_step)]


def launcher_env() -> dict:
    """This environment without a launcher's or gradientflow's variables (they would leak in)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GRADIENTFLOW_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return env


def rank_logs(log_dir: Path) -> dict[tuple[int, int], str]:
    """{(attempt, rank): stdout + stderr} from torchrun's --log-dir tree."""
    out = {}
    for attempt_dir in sorted(Path(log_dir).glob("*/attempt_*")):
        attempt = int(attempt_dir.name.split("_")[1])
        for rank_dir in sorted(p for p in attempt_dir.iterdir() if p.is_dir()):
            out[(attempt, int(rank_dir.name))] = "".join(
                (rank_dir / f).read_text(errors="replace")
                for f in ("stdout.log", "stderr.log") if (rank_dir / f).exists())
    return out


def format_logs(logs: dict, launcher: str = "") -> str:
    """Every rank's log of every attempt (tails), for a failure message."""
    parts = [f"--- torchrun\n{launcher[-3000:]}"] if launcher else []
    parts += [f"--- attempt {a}, rank {r}\n{text[-3000:]}" for (a, r), text in sorted(logs.items())]
    return "\n".join(parts)


def check_resumed(logs: dict, world: int = 2) -> dict:
    """The restart's evidence in the logs: the last rank killed itself in attempt 0, every rank
    of the last attempt resumed from a checkpoint (not from scratch) with the residuals it had
    saved (same checksum, not all zero). Raises AssertionError saying what is missing."""
    attempts = sorted({a for a, _r in logs})
    assert attempts and attempts[-1] >= 1, "no restart happened (only attempt 0 in torchrun's logs)"
    killed = [r for (a, r), text in logs.items() if a == 0 and _KILLED.search(text)]
    assert killed == [world - 1], (
        f"expected rank {world - 1} to kill itself in attempt 0, got {killed}")
    saved = {(int(m[1]), int(m[2])): m[3] for (a, _r), t in logs.items() if a == 0
             for m in _SAVED.finditer(t)}
    last = attempts[-1]
    resumed = {}
    for r in range(world):
        ms = list(_RESUMED.finditer(logs.get((last, r), "")))
        assert ms, (
            f"rank {r} did not resume from a checkpoint in attempt {last} (started from scratch?)")
        epoch, text, l1 = int(ms[0][2]), ms[0][3], float(ms[0][4])
        assert epoch >= 1 and (r, epoch - 1) in saved, (
            f"rank {r} resumed at epoch {epoch}, but attempt 0 saved no checkpoint of epoch "
            f"{epoch - 1}")
        assert text == saved[(r, epoch - 1)], (
            f"rank {r}: residuals loaded ({text}) differ from those saved "
            f"({saved[(r, epoch - 1)]})")
        assert l1 > 0, f"rank {r}: the saved residuals are all zero: the check would prove nothing"
        resumed[r] = {"epoch": epoch, "residuals": text}
    assert "epoch 0:" not in logs.get((last, 0), ""), f"attempt {last} trained epoch 0 again"
    return resumed
