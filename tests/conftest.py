"""Session-wide rank pools (one per world size), so each test pays no process start-up."""
from __future__ import annotations

import os
import sys

import pytest
from hypothesis import settings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import RankPool  # noqa: E402


def _triton_interprets() -> None:
    """Without a GPU, Triton's kernels run in its interpreter (tests/kernels/test_triton.py).

    Triton decides when it is first imported, its own library's kernels included, so this
    is set before any test imports it; a machine with a GPU compiles them as users do.
    """
    import torch

    if "triton" not in sys.modules and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_triton_interprets()

# HYPOTHESIS_PROFILE=ci: random (not derandomized) examples from one seed per run, printed in
# the header and under every failure (`--hypothesis-seed=N` replays the run), with the
# @reproduce_failure blob. Tests that set their own settings keep them.
settings.register_profile("ci", print_blob=True, derandomize=False, deadline=None)
_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "")
if _PROFILE:
    settings.load_profile(_PROFILE)


@pytest.fixture(autouse=True, scope="session")
def _kernels_loaded():
    """impl="auto" means the numba kernels in every test, as in the rank pools
    (tests/harness.py): until they are loaded the dispatch would run the torch reference
    (kernels/warm.py, whose own tests take that path on purpose), and a test that compares
    two runs must see one kernel."""
    from gradientflow.kernels import warm

    assert warm.wait(timeout=600), f"the CPU kernels did not load: {warm.error()!r}"


DEFAULT_TIMEOUT_S = 900  # the slowest multi-process test takes minutes on a loaded 2-core host


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """No in-process test may hang silently: a default per-test timeout (pytest-timeout, which
    then dumps every thread's stack), unless --timeout, PYTEST_TIMEOUT, `timeout = N` in the
    ini file or @pytest.mark.timeout says otherwise."""
    if (config.pluginmanager.hasplugin("timeout") and config.getoption("timeout", None) is None
            and not os.environ.get("PYTEST_TIMEOUT") and not config.getini("timeout")):
        config.option.timeout = DEFAULT_TIMEOUT_S
    if _PROFILE == "ci" and config.getoption("hypothesis_seed", None) is None:
        config.option.hypothesis_seed = str(int.from_bytes(os.urandom(4), "little"))


def _seed_line(config) -> str | None:
    seed = config.getoption("hypothesis_seed", None)
    if _PROFILE != "ci" or seed is None:
        return None
    return (f"hypothesis seed {seed}: replay with HYPOTHESIS_PROFILE=ci pytest "
            f"--hypothesis-seed={seed}")


def pytest_report_header(config):
    line = _seed_line(config)
    return [line] if line else []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    line = _seed_line(item.config)
    if line and report.failed:
        report.sections.append(("hypothesis seed", f"{line} {item.nodeid}"))


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
