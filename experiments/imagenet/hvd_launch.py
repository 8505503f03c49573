"""Horovod's ranks without horovodrun: its Gloo rendezvous server and each rank's environment.

horovodrun starts ranks over ssh on the hosts it is given; on the emulated switch every rank
is a process in its own network namespace, started by run_experiment.py. What horovodrun
would do is done here instead: Horovod's own RendezvousServer (one per run, in rank 0's
namespace) is given the slot plan, and each rank gets the HOROVOD_* variables horovodrun's
Gloo launcher sets (horovod/runner/gloo_run.py). Run as a script (by the Horovod
environment's python) it is that server:

    .venv-horovod/bin/python experiments/imagenet/hvd_launch.py HOST0,HOST1,...

prints the port it listens on, then serves until its standard input closes.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HOROVOD_VENV = REPO / ".venv-horovod"
HOROVOD_PYTHON = HOROVOD_VENV / "bin" / "python"


def horovod_unavailable(python: Path = HOROVOD_PYTHON) -> str | None:
    """Why Horovod cannot run here (one sentence), or None when its torch module imports."""
    if not python.exists():
        return (f"Horovod is not built here: `make horovod` builds 0.28.1 into {HOROVOD_VENV.name} "
                f"(about 20 minutes of one core)")
    probe = subprocess.run([str(python), "-c", "import horovod.torch as h; assert h.gloo_built()"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return f"Horovod in {HOROVOD_VENV.name} does not import with Gloo ({last})"
    return None


def slot_plan(hosts: list) -> list:
    """One slot per rank, in rank order: (hostname, rank, local_rank, cross_rank, size,
    local_size, cross_size), ranks of one hostname numbered locally as horovodrun does."""
    size = len(hosts)
    names = list(dict.fromkeys(hosts))  # hosts in order of first appearance
    plan = []
    for rank, host in enumerate(hosts):
        local = [r for r, h in enumerate(hosts) if h == host]
        plan.append((host, rank, local.index(rank), names.index(host), size, len(local),
                     len(names)))
    return plan


def rank_env(rank: int, hosts: list, server_addr: str, port: int, ifname: str,
             timeout_s: int = 120) -> dict:
    """The HOROVOD_* variables of `rank` (what horovodrun's Gloo launcher sets)."""
    host, rank, local_rank, cross_rank, size, local_size, cross_size = slot_plan(hosts)[rank]
    return {
        "HOROVOD_HOSTNAME": host, "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(size),
        "HOROVOD_LOCAL_RANK": str(local_rank), "HOROVOD_LOCAL_SIZE": str(local_size),
        "HOROVOD_CROSS_RANK": str(cross_rank), "HOROVOD_CROSS_SIZE": str(cross_size),
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": server_addr, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": ifname, "HOROVOD_GLOO_TIMEOUT_SECONDS": str(timeout_s),
    }


def start_server(argv_prefix: list, hosts: list, env: dict) -> tuple:
    """Start the rendezvous server (argv_prefix: e.g. `ip netns exec NS`); return (process,
    port). The server stops when the process's standard input is closed."""
    proc = subprocess.Popen([*argv_prefix, str(HOROVOD_PYTHON), __file__, ",".join(hosts)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
                            start_new_session=True)
    line = proc.stdout.readline().strip()
    if not line.isdigit():
        proc.kill()
        raise RuntimeError(f"Horovod's rendezvous server did not start (said {line!r})")
    return proc, int(line)


def serve(hosts: list) -> int:
    """Run Horovod's RendezvousServer for `hosts` (one entry per rank) until stdin closes."""
    from horovod.runner.common.util.hosts import SlotInfo
    from horovod.runner.http.http_server import RendezvousServer

    server = RendezvousServer(verbose=0)
    port = server.start()
    server.init([SlotInfo(*slot) for slot in slot_plan(hosts)])
    print(port, flush=True)
    sys.stdin.read()
    server.stop()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(serve(sys.argv[1].split(",")))
