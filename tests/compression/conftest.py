"""Hypothesis profile for the compression tests: no deadline (first calls compile numba kernels)."""
from __future__ import annotations

import os
import sys

from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

settings.register_profile(
    "compression", deadline=None, max_examples=40,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("GF_HYPOTHESIS_PROFILE", "compression"))
