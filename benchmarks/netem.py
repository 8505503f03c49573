"""Emulate a switched cluster on one machine: a network namespace per rank, shaped veth NICs.

Topology (N ranks)::

    [ns gfb-<tag>-r0] gfnic 10.213.7.1 --veth-- sw0 \
    [ns gfb-<tag>-r1] gfnic 10.213.7.2 --veth-- sw1  >- bridge "switch" in ns gfb-<tag>-sw
    ...                                            /

Every veth end carries a `tbf` qdisc at the tier's rate: tbf shapes only what *leaves* an
interface, so the rank end limits what a rank sends and the switch end limits what a rank
receives (otherwise traffic converging on one rank would not be limited). This kernel has tbf
but no netem, so no latency is added. Shaping the shared loopback would emulate a bus, not a
switch, which is why each rank gets its own NIC.

`Cluster` is a context manager that creates the namespaces and always removes them (on error
and on Ctrl-C too). Names carry the creating process id, and namespaces left by a crashed run
(whose creator is dead) are removed at start. When namespaces are not permitted, `Cluster`
says so in one line and every rank runs unshaped on loopback (`cluster.shaped` is False).

Run ``python -m benchmarks.netem`` to measure what each tier really achieves.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field

if __package__ in (None, ""):  # run by path: make benchmarks.* importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import sigterm_raises

# Private /24 used only inside the namespaces this module creates (never routed outside).
SUBNET = "10.213.7"
PREFIX = "gfb-"  # every namespace we create starts with this
NIC = "gfnic"  # the rank's NIC name, the same inside every rank namespace
HOST_LINK = "gfhost"  # the unshaped link between ranks of one emulated host (Cluster.hosts)
TIERS_GBPS = (1.0, 2.5, 5.0, 10.0)
_CMD_TIMEOUT_S = 20.0


class NetemUnavailable(RuntimeError):
    """Namespaces, veth, bridge or tbf are not permitted on this machine."""


@dataclass(frozen=True)
class ShapeConfig:
    """How each NIC is shaped.

    rate_gbps: link rate in Gbit/s; None leaves the links unshaped (veth speed).
    burst_us: token bucket depth as time at line rate; large enough for a 64 KB GSO packet,
        small enough not to let bursts through well above the rate.
    latency_ms: how long a packet may wait in tbf's queue before being dropped; generous so
        that TCP sees a deep switch buffer rather than drops (we add no propagation delay).
    mtu: the NICs' MTU (1500: ordinary Ethernet).
    """

    rate_gbps: float | None = None
    burst_us: float = 500.0
    latency_ms: float = 50.0
    mtu: int = 1500

    def __post_init__(self):
        if self.rate_gbps is not None and not self.rate_gbps > 0:
            raise ValueError(f"ShapeConfig.rate_gbps must be > 0 or None, got {self.rate_gbps}")

    def tbf_args(self) -> list[str]:
        """The `tc qdisc ... tbf` arguments for this shape."""
        rate_bps = self.rate_gbps * 1e9
        burst = max(int(rate_bps / 8 * self.burst_us * 1e-6), 128 * 1024)
        return ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst),
                "latency", f"{self.latency_ms}ms"]

    @property
    def label(self) -> str:
        return "unshaped" if self.rate_gbps is None else f"{self.rate_gbps:g} Gbps"


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    except FileNotFoundError as exc:
        raise NetemUnavailable(f"{argv[0]} is not installed") from exc
    if check and proc.returncode != 0:
        raise NetemUnavailable(f"`{' '.join(argv)}` failed: {proc.stderr.strip()}")
    return proc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces() -> list[str]:
    """Names of the network namespaces this module created (any run)."""
    proc = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines()
            if line.split() and line.split()[0].startswith(PREFIX)]


def clean_stale() -> list[str]:
    """Remove namespaces left by crashed runs (creator process dead); return their names."""
    removed = []
    for name in list_namespaces():
        m = re.match(rf"{PREFIX}(\d+)-", name)
        if m and not _pid_alive(int(m.group(1))):
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    return removed


@dataclass
class Cluster:
    """A switched cluster of `world_size` ranks on one machine; use as a context manager.

    Args:
        world_size: number of rank namespaces.
        shape: how each NIC is shaped (both directions).
        allow_fallback: when namespaces are not permitted, say so in one line and run on
            loopback instead of raising.
        hosts: optional host index of each rank. Ranks of one host keep their own shaped NIC
            and are also joined by an unshaped link (a bridge of HOST_LINK veths, MTU 65535,
            standing for the host's memory bus): traffic between them takes that link, all
            other traffic the NIC.

    Example::

        with Cluster(2, ShapeConfig(rate_gbps=1)) as c:
            subprocess.run(c.wrap(0, ["python", "-c", "print(1)"]), env=c.env(0), timeout=60)
    """

    world_size: int
    shape: ShapeConfig = field(default_factory=ShapeConfig)
    allow_fallback: bool = True
    hosts: tuple[int, ...] | None = None
    # internal
    shaped: bool = False
    tag: str = ""
    reason: str = ""
    _namespaces: list[str] = field(default_factory=list)

    # -- addressing ---------------------------------------------------------------------------
    def ns(self, rank: int) -> str:
        return f"{PREFIX}{self.tag}-r{rank}"

    @property
    def switch_ns(self) -> str:
        return f"{PREFIX}{self.tag}-sw"

    def addr(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}" if self.shaped else "127.0.0.1"

    @property
    def master_addr(self) -> str:
        return self.addr(0)

    @property
    def ifname(self) -> str:
        return NIC if self.shaped else "lo"

    def wrap(self, rank: int, argv: list[str]) -> list[str]:
        """Prefix `argv` so that it runs inside rank's namespace (unchanged on loopback)."""
        return ["ip", "netns", "exec", self.ns(rank), *argv] if self.shaped else list(argv)

    def env(self, rank: int, master_port: int, base: dict | None = None) -> dict:
        """The environment of rank's process: torch.distributed rendezvous and gloo NIC."""
        env = dict(os.environ if base is None else base)
        env.update(RANK=str(rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(rank),
                   MASTER_ADDR=self.master_addr, MASTER_PORT=str(master_port),
                   GLOO_SOCKET_IFNAME=self.ifname)
        return env

    # -- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        if self.world_size < 1 or self.world_size > 250:
            raise ValueError(f"Cluster.world_size must be in 1..250, got {self.world_size}")
        if self.hosts is not None and len(self.hosts) != self.world_size:
            raise ValueError(f"Cluster.hosts names {len(self.hosts)} ranks, world_size is "
                             f"{self.world_size}")
        self.tag = str(os.getpid())
        if os.geteuid() != 0:
            return self._fallback("not root")
        clean_stale()
        # A SIGTERM (runner's time limit) while we exist must still tear down: make it raise.
        self._sigterm = sigterm_raises()
        self._sigterm.__enter__()
        try:
            self._build()
        except NetemUnavailable as exc:
            self.__exit__(None, None, None)
            if not self.allow_fallback:
                raise
            return self._fallback(str(exc))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.shaped = True
        return self

    def __exit__(self, *exc) -> None:
        self._teardown()
        if getattr(self, "_sigterm", None) is not None:
            self._sigterm.__exit__(None, None, None)
            self._sigterm = None

    def _fallback(self, why: str) -> Cluster:
        self.shaped = False
        self.reason = why
        print(f"netem: network namespaces not permitted ({why}); running unshaped on loopback",
              file=sys.stderr)
        return self

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._namespaces.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _build(self) -> None:
        sw = self.switch_ns
        self._add_ns(sw)
        _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", "br0", "up"])
        for r in range(self.world_size):
            ns = self.ns(r)
            self._add_ns(ns)
            # Create the pair inside the rank namespace (no names in the root namespace at all),
            # then move its peer into the switch.
            port = f"sw{r}"
            _run(["ip", "-n", ns, "link", "add", NIC, "mtu", str(self.shape.mtu), "type", "veth",
                  "peer", "name", port, "mtu", str(self.shape.mtu), "netns", sw])
            _run(["ip", "-n", ns, "addr", "add", f"{self.addr_for(r)}/24", "dev", NIC])
            _run(["ip", "-n", ns, "link", "set", NIC, "up"])
            _run(["ip", "-n", sw, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", sw, "link", "set", port, "up"])
            if self.shape.rate_gbps is not None:
                for where, dev in ((ns, NIC), (sw, port)):
                    _run(["tc", "-n", where, "qdisc", "replace", "dev", dev, "root",
                          *self.shape.tbf_args()])
        self._build_hosts(sw)

    def _build_hosts(self, sw: str) -> None:
        """The unshaped links between ranks of one host: a bridge per host in the switch
        namespace, and a /32 route in each member to each other member through it."""
        if self.hosts is None:
            return
        for h in sorted(set(self.hosts)):
            members = [r for r, x in enumerate(self.hosts) if x == h]
            if len(members) < 2:
                continue
            br = f"hb{h}"
            _run(["ip", "-n", sw, "link", "add", br, "type", "bridge"])
            _run(["ip", "-n", sw, "link", "set", br, "up"])
            for r in members:
                ns, port = self.ns(r), f"h{r}"
                _run(["ip", "-n", ns, "link", "add", HOST_LINK, "mtu", "65535", "type", "veth",
                      "peer", "name", port, "mtu", "65535", "netns", sw])
                _run(["ip", "-n", ns, "link", "set", HOST_LINK, "up"])
                _run(["ip", "-n", sw, "link", "set", port, "master", br])
                _run(["ip", "-n", sw, "link", "set", port, "up"])
                for o in members:
                    if o != r:
                        _run(["ip", "-n", ns, "route", "add", f"{self.addr_for(o)}/32", "dev",
                              HOST_LINK, "src", self.addr_for(r)])

    def addr_for(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    def _teardown(self) -> None:
        # Deleting a namespace deletes the veth ends in it, their peers and qdiscs with them.
        for name in reversed(self._namespaces):
            _run(["ip", "netns", "del", name], check=False)
        self._namespaces.clear()

    def describe(self) -> str:
        if not self.shaped:
            return f"{self.world_size} ranks on loopback, unshaped ({self.reason or 'requested'})"
        return (f"{self.world_size} ranks, one namespace each, veth into a bridge; "
                f"{self.shape.label} tbf both directions, MTU {self.shape.mtu}")


# ---- tier measurement -------------------------------------------------------------------------

def probe_worker(rank: int, world_size: int, mbytes: float = 64.0, reps: int = 5) -> dict:
    """Time a gloo allreduce of `mbytes` MB; return the median and bus bandwidth (Gbit/s)."""
    import torch
    import torch.distributed as dist

    from benchmarks.common import median, time_calls

    x = torch.ones(int(mbytes * 1e6 / 4), dtype=torch.float32)
    # one untimed call warms the connections
    t = median(time_calls(lambda: dist.all_reduce(x), reps, warmup=1, before=dist.barrier))
    n = world_size
    # Ring allreduce moves 2(n-1)/n of the message through every link: that is the bus bandwidth.
    busbw = 2 * (n - 1) / n * x.numel() * 4 * 8 / t / 1e9 if n > 1 else float("inf")
    return {"seconds": t, "busbw_gbps": busbw, "bytes": x.numel() * 4}


def measure_tiers(tiers=(None, *TIERS_GBPS), world_size: int = 2, mbytes: float = 64.0,
                  timeout_s: float = 120.0) -> list[dict]:
    """Measure the achieved gloo allreduce bus bandwidth of each tier (None = unshaped)."""
    from benchmarks.launch import launch

    rows = []
    for rate in tiers:
        shape = ShapeConfig(rate_gbps=rate)
        with Cluster(world_size, shape) as cluster:
            res = launch("benchmarks.netem:probe_worker", world_size, {"mbytes": mbytes},
                         cluster=cluster, timeout_s=timeout_s)
            r0 = res.results[0] if res.ok else {}
            rows.append({"tier": shape.label, "rate_gbps": rate, "shaped": cluster.shaped,
                         "ok": res.ok, "error": res.error,
                         "allreduce_ms": r0.get("seconds", float("nan")) * 1e3,
                         "busbw_gbps": r0.get("busbw_gbps", float("nan"))})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mbytes", type=float, default=64.0)
    ap.add_argument("--clean", action="store_true", help="only remove leftover namespaces")
    args = ap.parse_args(argv)
    if args.clean:
        print("removed:", clean_stale() or "nothing")
        return 0
    from benchmarks.common import markdown_table

    rows = measure_tiers(world_size=args.ranks, mbytes=args.mbytes)
    print(markdown_table(["tier", "shaped", "allreduce_ms", "busbw_gbps", "error"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
