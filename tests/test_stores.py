"""Store connections: whatever may wait in the store while another thread of the rank uses it
takes a connection of its own (gradientflow/stores.py).

The shared connection is modelled as a store that refuses every request, as one held by
another thread's wait would (the real case hangs until the store's timeout): each piece must
get through on its own connection, deterministically, with one rank and no peer."""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from gradientflow.algorithms import Algorithms
from gradientflow.backend.transports import Transports, make_gloo
from gradientflow.config import Config

TIMEOUT = datetime.timedelta(seconds=10)


class Held(dist.Store):
    """A connection held by another thread: every request on it fails; clone() reaches the
    real store."""

    def __init__(self, real) -> None:
        super().__init__()
        self.real = real
        self.used: list[str] = []

    def clone(self):
        return self.real.clone()

    def _held(self, name: str):
        self.used.append(name)
        raise RuntimeError(f"{name} on the shared connection, which another thread holds")

    def set(self, *args):
        self._held("set")

    def get(self, *args):
        self._held("get")

    def wait(self, *args):
        self._held("wait")

    def check(self, *args):
        self._held("check")


@pytest.fixture
def held():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=TIMEOUT)
    return Held(server)


def test_transports_created_on_first_use_meet_on_their_own_connection(held):
    transports = Transports(held, 0, 1, TIMEOUT, prefix="gradientflow/solo-", connect_cpu=False)
    pg = transports.get(torch.device("cpu"))
    t = torch.ones(3)
    pg.allreduce([t]).wait()
    assert torch.equal(t, torch.ones(3)) and held.used == []


def test_transports_connected_at_init_use_the_group_connection(held):
    # at init no other thread of the rank exists: the shared connection is the right one,
    # and a held one surfaces as an error rather than a hang
    with pytest.raises(Exception, match="another thread holds"):
        Transports(held, 0, 1, TIMEOUT)
    assert held.used


@pytest.mark.parametrize("algorithm", ["hierarchical", "auto"])
def test_topology_and_subgroups_meet_on_their_own_connection(held, algorithm):
    made = []

    def make_group(store, device_type, rank, size, prefix):
        made.append(store)
        return make_gloo(store, rank, size, TIMEOUT, prefix)

    cfg = Config.resolve({"algorithm": algorithm, "host": "h0"}, environ={})
    algos = Algorithms(cfg, held, 0, 1, TIMEOUT.total_seconds(), make_group, "g")
    assert algos.topology().hosts == ((0,),)
    make = algos.group_maker()
    for device_type in ("cpu", "cuda"):  # the store is chosen before the device's factory
        make(device_type, 0, 1, f"x/{device_type}/")
    assert held.used == [] and len(made) == 2
    assert made[0] is made[1] and made[0] is not held  # one connection per channel
