"""Where and when a run was made: the commit, the host, UTC times, each rank's CPU time.

Every run's meta file (run_experiment.run_one) carries these, so that a table drawn from many
logs can say whether they came from one invocation of one commit on one machine.
"""
from __future__ import annotations

import datetime
import re
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def utc_now() -> str:
    """The time now, UTC, to the second (ISO 8601)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def commit() -> str:
    """The checkout's commit, with "+dirty" when tracked files differ from it ("unknown" outside
    a git checkout). Read when a run starts: the code it runs is the checkout's at its launch."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO,
                              capture_output=True, text=True, timeout=30, check=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.strip() + ("+dirty" if dirty.strip() else "")


def host() -> str:
    """The machine's host name."""
    return socket.gethostname()


def run_fields(log: list) -> dict:
    """What a finished run's log says it cost: each rank's CPU seconds (the last epoch's
    cumulative count) and their sum."""
    cpu = log[-1].get("rank_cpu_s") if log else None
    return {"rank_cpu_s": cpu, "cpu_s": round(sum(cpu), 1) if cpu else None}


def thread_cpu_seconds() -> dict:
    """This process's CPU time so far (user + system) by kind of thread, in seconds: Python's
    threads by their names, the others (gloo's) by the name the OS has for them, digits folded
    to "N" (the engines of several groups, "0-engine" and "1-engine", are one kind); {} where
    /proc does not say. A thread that ended is not counted."""
    if str(REPO) not in sys.path:  # train.py runs with its own folder first on the path
        sys.path.insert(0, str(REPO))
    from benchmarks.common import thread_cpu_seconds as by_name

    out: dict = {}
    for name, sec in by_name().items():
        kind = re.sub(r"\d+", "N", name)
        out[kind] = out.get(kind, 0.0) + sec
    return {k: round(v, 2) for k, v in sorted(out.items())}
