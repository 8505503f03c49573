"""Collective algorithms on the emulated network: hierarchical vs ring, reduction_server vs ring.

Two setups, each timed alternately rep by rep in one launch (side-by-side ratios):

  - hosts: 2 hosts x 2 ranks. One network namespace per host (benchmarks/netem.py, tbf both
    ways on its NIC); a host's two ranks talk over that namespace's loopback. ResNet-50's
    gradient list, one async allreduce per tensor in backward order (the engine fuses them),
    on a gradientflow group per algorithm (ring, hierarchical). Counted: each host NIC's bytes
    (the kernel's counters, headers included) and the algorithms' own counters per rank.
  - reducers: 4 workers and R reducers (python -m gradientflow.reducer), each process in its
    own namespace with its own shaped NIC. The same list on ring and reduction_server groups.
    Counted: the bytes each worker's NIC sent and received per list, against |D|; the time
    and the algorithm bandwidth |D| / time, and its ratio to ring's.

    Also counted per list: the CPU seconds of the workers and the reducers, the messages the
    engine cut it into, a small allreduce's latency, and the links' floor (wire_floor_s).

    python benchmarks/bench_algorithms.py [--quick] [--out DIR] [--tiers 1,10] [--reducers 1,2,4]
        [--reducer-tiers 1,none] [--model flat:resnet50] [--rs-rounds 4096,256]

'none' leaves the links unshaped (what the CPU alone allows); flat:<model> sends the list as
one tensor (one message); --rs-rounds adds reduction_server groups with other piece sizes.
"""
from __future__ import annotations

import argparse
import datetime
import os
import signal
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import machine_line, markdown_table, median, write_result  # noqa: E402
from benchmarks.launch import launch  # noqa: E402
from benchmarks.netem import NIC, Cluster, ShapeConfig  # noqa: E402

NAME = "algorithms"


class Placed:
    """A Cluster whose ranks sit in given namespaces (several ranks may share one: a host).

    `host_of`: each rank's host, as torchrun would number it (default: its namespace)."""

    def __init__(self, cluster: Cluster, ns_of: list[int],
                 host_of: list[int] | None = None) -> None:
        self.cluster = cluster
        self.ns_of = ns_of
        self.host_of = list(ns_of if host_of is None else host_of)
        self.world_size = len(ns_of)
        self.shaped = cluster.shaped

    def wrap(self, rank: int, argv: list[str]) -> list[str]:
        return self.cluster.wrap(self.ns_of[rank], argv)

    def env(self, rank: int, master_port: int, base: dict | None = None) -> dict:
        env = self.cluster.env(self.ns_of[rank], master_port, base)
        local = [r for r in range(self.world_size) if self.host_of[r] == self.host_of[rank]]
        # torchrun's view: ranks of one host are numbered from RANK - LOCAL_RANK on.
        env.update(RANK=str(rank), WORLD_SIZE=str(self.world_size),
                   LOCAL_RANK=str(local.index(rank)), LOCAL_WORLD_SIZE=str(len(local)))
        return env


def nic_counters(ifname: str = NIC) -> tuple[int, int]:
    """(tx, rx) bytes of `ifname` in this namespace so far ((0, 0) where it does not exist:
    on loopback, not counted)."""
    base = f"/sys/class/net/{ifname}/statistics/"
    try:
        with open(base + "tx_bytes") as f:
            tx = int(f.read())
        with open(base + "rx_bytes") as f:
            rx = int(f.read())
        return tx, rx
    except OSError:
        return 0, 0


def _grads(model: str):
    """The model's gradient list in backward order; "flat:<model>": one tensor of the same
    size instead (one message for the algorithm: no per-message costs)."""
    import math

    import torch

    from benchmarks.bench_fusion import gradient_shapes

    flat = model.startswith("flat:")
    shapes = gradient_shapes(model.removeprefix("flat:"))
    if flat:
        return [torch.ones(sum(math.prod(s) for s in shapes))]
    return [torch.ones(s) for s in reversed(shapes)]


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system, every thread) the processes `pids` have used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def _small_allreduce_ms(reps: int = 21) -> float:
    """Median time of an 8-word allreduce on the default gloo group (this network's latency
    for what every reduction_server message ends with: the workers' agreement)."""
    import torch
    import torch.distributed as dist

    v = torch.zeros(8, dtype=torch.int64)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dist.all_reduce(v)
        times.append(time.perf_counter() - t0)
    return median(times) * 1e3


def _time_lists(groups: dict, grads: list, reps: int, count_rank: bool,
                other_pids: list[int] | None = None, before: dict | None = None) -> dict:
    """Allreduce the list on each group alternately, `reps` times; time, NIC bytes, and the
    CPU seconds of this process and of `other_pids` (the reducers) per list. `before[name]()`
    runs before each list of group `name` (a setting to compare side by side)."""
    before = before or {}
    import torch.distributed as dist

    from gradientflow.algorithms import algorithm_stats, reset_algorithm_stats

    def one(pg):
        works = [dist.all_reduce(g, group=pg, async_op=True) for g in grads]
        for w in works:
            w.wait()

    for name, pg in groups.items():  # warm: groups, subgroups, reducers connected
        before.get(name, lambda: None)()
        one(pg)
    out = {a: {"s": [], "tx": [], "rx": [], "cpu": [], "other_cpu": []} for a in groups}
    reset_algorithm_stats()
    me = [os.getpid()]
    for _ in range(reps):
        for name, pg in groups.items():
            before.get(name, lambda: None)()
            dist.barrier()
            tx0, rx0 = nic_counters()
            c0, o0 = _cpu_s(me), _cpu_s(other_pids or [])
            t0 = time.perf_counter()
            one(pg)
            dt = time.perf_counter() - t0
            c1, o1 = _cpu_s(me), _cpu_s(other_pids or [])
            dist.barrier()
            tx1, rx1 = nic_counters()
            out[name]["s"].append(dt)
            out[name]["cpu"].append(c1 - c0)
            out[name]["other_cpu"].append(o1 - o0)
            if count_rank:
                out[name]["tx"].append(tx1 - tx0)
                out[name]["rx"].append(rx1 - rx0)
    out["counters"] = algorithm_stats()
    out["small_allreduce_ms"] = _small_allreduce_ms()
    return out


def hosts_worker(rank: int, world_size: int, model: str, reps: int) -> dict:
    """One rank of the 2 hosts x 2 ranks run: ring vs hierarchical on the model's list."""
    import torch.distributed as dist

    grads = _grads(model)
    groups = {a: dist.new_group(backend="gradientflow", pg_options={"algorithm": a})
              for a in ("ring", "hierarchical")}
    res = _time_lists(groups, grads, reps, count_rank=True)
    res["bytes"] = sum(g.numel() * 4 for g in grads)
    return res


def reducers_worker(rank: int, world_size: int, model: str, reps: int, reducers: int,
                    reducer_prefixes: list[list[str]], store_addr: str, log_dir: str,
                    rounds_kib: list[int] | None = None) -> dict:
    """One worker of the reducers run: ring vs reduction_server (rank 0 starts the reducers).
    `rounds_kib`: also reduction_server with each of these ROUND_BYTES (KiB), side by side."""
    import torch.distributed as dist

    from gradientflow.algorithms import reduction_server as rs

    procs = start_reducers(world_size, reducer_prefixes, store_addr, log_dir) if rank == 0 else []
    try:
        grads = _grads(model)
        timeout = datetime.timedelta(seconds=120)
        groups = {"ring": dist.new_group(backend="gradientflow", timeout=timeout,
                                         pg_options={"algorithm": "ring"}),
                  "reduction_server": dist.new_group(
                      backend="gradientflow", timeout=timeout,
                      pg_options={"algorithm": "reduction_server", "reducers": reducers})}
        default = rs.ROUND_BYTES
        before = {"reduction_server": lambda: setattr(rs, "ROUND_BYTES", default)}
        for kib in rounds_kib or []:
            name = f"reduction_server@{kib}KiB"
            groups[name] = dist.new_group(
                backend="gradientflow", timeout=timeout,
                pg_options={"algorithm": "reduction_server", "reducers": reducers})
            before[name] = lambda b=kib * 1024: setattr(rs, "ROUND_BYTES", b)
        res = _time_lists(groups, grads, reps, count_rank=True,
                          other_pids=[p.pid for p in procs], before=before)
        res["algorithms"] = list(groups)
        res["bytes"] = sum(g.numel() * 4 for g in grads)
        dist.barrier()
        return res
    finally:
        stop_reducers(procs)


def start_reducers(workers: int, prefixes: list[list[str]], store_addr: str,
                   log_dir: str) -> list[subprocess.Popen]:
    """Start one reducer per prefix (its namespace's `ip netns exec`), against this job's
    store; each in a session of its own, so stop_reducers kills it with its children."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo, OMP_NUM_THREADS="1")
    procs = []
    for j, prefix in enumerate(prefixes):
        with open(f"{log_dir}/reducer{j}.log", "w") as log:
            procs.append(subprocess.Popen(
                [*prefix, sys.executable, "-m", "gradientflow.reducer", "--workers",
                 str(workers), "--reducers", str(len(prefixes)), "--index", str(j), "--store",
                 f"{store_addr}:{os.environ['MASTER_PORT']}"], env=env,
                stdout=subprocess.DEVNULL, stderr=log, start_new_session=True))
    return procs


def stop_reducers(procs: list[subprocess.Popen]) -> None:
    """Kill the reducers start_reducers started (their whole sessions) and reap them."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=10)


def run_hosts(rate: float | None, model: str, reps: int, timeout_s: float) -> list[dict]:
    rows = []
    with Cluster(2, ShapeConfig(rate_gbps=rate)) as cluster:
        placed = Placed(cluster, [0, 0, 1, 1])
        res = launch("benchmarks.bench_algorithms:hosts_worker", 4,
                     {"model": model, "reps": reps}, cluster=placed, timeout_s=timeout_s)
        if not res.ok:
            print(res.error, file=sys.stderr)
            return [{"setup": "2 hosts x 2", "tier": ShapeConfig(rate_gbps=rate).label,
                     "error": res.error.splitlines()[0][:300]}]
        d = res.results[0]["bytes"]
        ring_s = median(res.results[0]["ring"]["s"])
        for alg in ("ring", "hierarchical"):
            # Host NICs: local rank 0 of each host (ranks 0 and 2) reads its namespace's NIC.
            host_tx = [median(res.results[r][alg]["tx"]) for r in (0, 2)]
            c = [res.results[r]["counters"].get(alg, {}) for r in range(4)]
            counted = [x.get("inter_host_sent_bytes", 0) / max(1, x.get("messages", 1)) for x in c]
            per_list = [x.get("bytes", 0) / max(1, x.get("messages", 1)) for x in c]
            rows.append({
                "setup": "2 hosts x 2", "tier": ShapeConfig(rate_gbps=rate).label,
                "shaped": cluster.shaped, "algorithm": alg,
                "list_ms": median(res.results[0][alg]["s"]) * 1e3,
                "vs_ring": ring_s / median(res.results[0][alg]["s"]),
                "host_nic_tx_per_rank_D": (sum(host_tx) / 4 / d) if cluster.shaped else None,
                "counted_inter_host_per_rank_D": sum(
                    counted[r] / max(1.0, per_list[r]) for r in range(4)) / 4,
                "D_MB": d / 1e6})
    return rows


def run_reducers(rate: float | None, reducers: int, model: str, reps: int,
                 timeout_s: float, log_dir: str, rounds_kib: list[int] | None = None
                 ) -> list[dict]:
    rows = []
    workers = 4
    with Cluster(workers + reducers, ShapeConfig(rate_gbps=rate)) as cluster:
        placed = Placed(cluster, list(range(workers)))
        prefixes = [cluster.wrap(workers + j, []) for j in range(reducers)]
        res = launch("benchmarks.bench_algorithms:reducers_worker", workers,
                     {"model": model, "reps": reps, "reducers": reducers,
                      "reducer_prefixes": prefixes, "store_addr": cluster.master_addr,
                      "log_dir": log_dir, "rounds_kib": rounds_kib},
                     cluster=placed, timeout_s=timeout_s,
                     env_extra={"GLOO_SOCKET_IFNAME": cluster.ifname})
        tier = ShapeConfig(rate_gbps=rate).label
        if not res.ok:
            print(res.error, f"(reducers' logs in {log_dir})", file=sys.stderr)
            return [{"setup": f"4 workers + {reducers} reducers", "tier": tier,
                     "error": res.error.splitlines()[0][:300]}]
        d = res.results[0]["bytes"]
        ring_s = median(res.results[0]["ring"]["s"])
        names = res.results[0]["algorithms"]
        for alg in names:
            base = alg.split("@")[0]
            s = median(res.results[0][alg]["s"])
            tx = median([median(res.results[r][alg]["tx"]) for r in range(workers)])
            rx = median([median(res.results[r][alg]["rx"]) for r in range(workers)])
            cpu = sum(median(res.results[r][alg]["cpu"]) for r in range(workers))
            red_cpu = median(res.results[0][alg]["other_cpu"]) if base != "ring" else 0.0
            same = sum(1 for a in names if a.split("@")[0] == base)  # groups counted together
            msgs = res.results[0]["counters"].get(base, {}).get("messages", 0) / reps / same
            rows.append({
                "setup": f"4 workers + {reducers} reducers", "tier": tier,
                "shaped": cluster.shaped, "algorithm": alg, "list_ms": s * 1e3,
                "vs_ring": ring_s / s, "algbw_gbps": d * 8 / s / 1e9,
                "wire_floor_ms": wire_floor_s(base, d, workers, reducers, rate) * 1e3
                if rate else None,
                # what the processes themselves burn per list (kernel forwarding in the
                # namespaces' veths and bridge comes on top, charged to no one of them)
                "workers_cpu_s": cpu, "reducers_cpu_s": red_cpu,
                "messages": msgs, "small_allreduce_ms": res.results[0]["small_allreduce_ms"],
                "worker_nic_tx_D": tx / d if cluster.shaped else None,
                "worker_nic_rx_D": rx / d if cluster.shaped else None, "D_MB": d / 1e6})
    return rows


def wire_floor_s(algorithm: str, nbytes: int, workers: int, reducers: int,
                 rate_gbps: float) -> float:
    """The least time the NICs allow one allreduce of `nbytes` (full duplex, no latency):
    ring 2(n-1)/n D / B on every link; reduction_server D / B on a worker's link and
    n D / R on a reducer's, the larger of the two."""
    bps = rate_gbps * 1e9 / 8
    if algorithm == "ring":
        return 2 * (workers - 1) / workers * nbytes / bps
    return max(1.0, workers / reducers) * nbytes / bps


def _rate(text: str) -> float | None:
    """A tier from the command line: Gbit/s, or 'none' for unshaped NICs."""
    return None if text.strip().lower() == "none" else float(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 Gbps only, 2 reps, 1 and 4 reducers")
    ap.add_argument("--out", default="benchmarks/results/algorithms")
    ap.add_argument("--tiers", default="1,10", help="NIC rates in Gbit/s")
    ap.add_argument("--reducers", default="1,2,4")
    ap.add_argument("--reducer-tiers", default="1",
                    help="NIC rates of the reducers setup ('none': unshaped)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--model", default="resnet50",
                    help="whose gradient list; flat:<model> allreduces it as one tensor")
    ap.add_argument("--skip", default="", help="hosts or reducers: leave that setup out")
    ap.add_argument("--rs-rounds", default="",
                    help="KiB list: reduction_server also with these ROUND_BYTES, side by side")
    args = ap.parse_args(argv)
    tiers = [_rate(x) for x in args.tiers.split(",") if x]
    rtiers = [_rate(x) for x in args.reducer_tiers.split(",") if x]
    reducers = [int(x) for x in args.reducers.split(",") if x]
    reps = args.reps
    if args.quick:
        tiers, rtiers, reducers, reps = [1.0], [1.0], [1, 4], 2
    timeout_s = 600.0
    log_dir = tempfile.mkdtemp(prefix="gfb-reducers-")  # the reducers' logs, named on failure
    rows_h, rows_r = [], []
    if "hosts" not in args.skip:
        for rate in tiers:
            rows_h += run_hosts(rate, args.model, reps, timeout_s)
            print(markdown_table(list(rows_h[-1].keys()), rows_h[-2:]), flush=True)
    if "reducers" not in args.skip:
        for rate in rtiers:
            for r in reducers:
                rows_r += run_reducers(rate, r, args.model, reps, timeout_s, log_dir,
                                       [int(k) for k in args.rs_rounds.split(",") if k])
                print(markdown_table(list(rows_r[-1].keys()), rows_r[-2:]), flush=True)
    md = [f"## Collective algorithms ({args.model} list, {reps} reps, medians)", "",
          machine_line(), "The machine is shared with other jobs: times are noisy; ratios "
          "come from the same launch, rep by rep.", ""]
    if rows_h:
        md += ["### 2 hosts x 2 ranks: hierarchical vs ring", "",
               markdown_table(["tier", "algorithm", "list_ms", "vs_ring",
                               "host_nic_tx_per_rank_D", "counted_inter_host_per_rank_D",
                               "D_MB", "error"], rows_h), ""]
    if rows_r:
        md += ["### 4 workers + R reducers: reduction_server vs ring", "",
               markdown_table(["setup", "tier", "algorithm", "list_ms", "vs_ring", "algbw_gbps",
                               "wire_floor_ms", "workers_cpu_s", "reducers_cpu_s", "messages",
                               "small_allreduce_ms", "worker_nic_tx_D", "worker_nic_rx_D",
                               "D_MB", "error"], rows_r), ""]
    text = "\n".join(md)
    print(text)
    write_result(args.out, NAME, {"hosts": rows_h, "reducers": rows_r, "reps": reps,
                                  "model": args.model, "argv": argv or sys.argv[1:]}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
