"""The emulated hosts of bench_algorithms_e2e: ranks of one host reach each other over the
unshaped host link, everyone else over their shaped NICs (benchmarks/netem.py Cluster.hosts)."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from benchmarks.netem import HOST_LINK, NIC, Cluster, ShapeConfig


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                    reason="network namespaces need root and iproute2")
def test_ranks_of_a_host_route_through_the_host_link():
    with Cluster(3, ShapeConfig(rate_gbps=1.0), hosts=(0, 0, 1)) as c:
        if not c.shaped:
            pytest.skip(f"namespaces not permitted here: {c.reason}")

        def dev(rank: int, to: int) -> str:
            out = subprocess.run(c.wrap(rank, ["ip", "route", "get", c.addr_for(to)]),
                                 capture_output=True, text=True, timeout=20, check=True)
            return out.stdout.split(" dev ")[1].split()[0]

        assert dev(0, 1) == HOST_LINK and dev(1, 0) == HOST_LINK
        assert dev(0, 2) == NIC and dev(2, 0) == NIC and dev(1, 2) == NIC


def test_hosts_must_name_every_rank():
    with pytest.raises(ValueError, match="hosts names 2 ranks, world_size is 3"):
        with Cluster(3, ShapeConfig(rate_gbps=1.0), hosts=(0, 0)):
            pass
