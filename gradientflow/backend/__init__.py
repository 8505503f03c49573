"""The torch.distributed backend over the engine, and how the layers above reach it.

`backend_of(group)` (its `.config`, `.engine`, `.inspector`), `submit_stages`, `flush` and
`allreduce_async` are what hooks and the optimizer use; backend.py is the Backend class itself.
"""
from gradientflow.backend.api import allreduce_async, flush, submit_stages
from gradientflow.backend.registry import backend_of, config_of

__all__ = ["allreduce_async", "backend_of", "config_of", "flush", "submit_stages"]
