"""The torch.distributed backend over the engine, and how the layers above reach it.

`backend_of(group)` (its `.config`, `.engine`, `.inspector`), `submit_stages`, `flush` and
`scheduler_of` are what hooks and the optimizer use; backend.py is the Backend class itself.
"""
from gradientflow.backend.api import flush, scheduler_of, submit_stages
from gradientflow.backend.registry import backend_of, config_of

__all__ = ["backend_of", "config_of", "flush", "scheduler_of", "submit_stages"]
