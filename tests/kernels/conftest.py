"""Shared helpers of the kernel tests."""

from bits import assert_same_bits  # noqa: F401 - re-exported for `from .conftest import ...`
