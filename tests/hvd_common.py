"""What the Horovod tests' rank bodies share."""
from __future__ import annotations


def session(fn):
    """Run fn(hvd, torch) between hvd.init() and hvd.shutdown() (the harness owns the group)."""
    import torch

    import gradientflow.horovod as hvd

    hvd.init()
    try:
        return fn(hvd, torch)
    finally:
        hvd.shutdown()
