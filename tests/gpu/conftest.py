"""GPU tests: collected everywhere, skipped unless torch sees a CUDA device (CI has none)."""
from __future__ import annotations

import pytest
import torch

HAVE_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    """Skip every test of this folder on a machine without CUDA, with the reason."""
    if HAVE_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
