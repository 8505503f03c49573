"""Session-wide rank pools (one per world size), so each test pays no process start-up."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import RankPool  # noqa: E402

_pools: dict[int, RankPool] = {}


@pytest.fixture(scope="session")
def pools():
    """pools(n) -> the RankPool of world size n (started on first use, closed at the end)."""

    def get(n: int) -> RankPool:
        if n not in _pools:
            _pools[n] = RankPool(n)
        return _pools[n]

    yield get
    for pool in _pools.values():
        pool.close()
