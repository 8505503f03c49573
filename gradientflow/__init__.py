"""GradientFlow: a torch.distributed backend for communication-bound data-parallel training.

`import gradientflow` registers the backend (so does torch itself, through the entry point,
in scripts that never import us): `torch.distributed.init_process_group(backend="gradientflow")`.
"""
from gradientflow._registrar import BACKEND_NAME, register as _register
from gradientflow.config import Config, configure
from gradientflow.backend.api import flush, monitored_barrier
from gradientflow.observability.stats import reset_stats, stats
from gradientflow.observability.timeline import TIMELINE as _TIMELINE
from gradientflow.observability.timeline import start_timeline, stop_timeline

_register()

__version__ = "0.1.0"


def mark_step(step: int) -> None:
    """Mark the start of training step `step` (timeline markers and sampling; step counter)."""
    from gradientflow.observability.stats import STATS

    STATS.record_step()
    _TIMELINE.mark_step(step)


# Imported on first use, so that `import gradientflow` (and the backend) stay light: the
# optimizer and the hooks pull in the compressors and the numba kernels.
_LAZY = {
    "DistributedOptimizer": "gradientflow.optim",
    "broadcast_parameters": "gradientflow.optim",
    "broadcast_optimizer_state": "gradientflow.optim",
    "Average": "gradientflow.optim",
    "Sum": "gradientflow.optim",
}
_SUBMODULES = {"compression", "hooks", "optim", "engine", "kernels", "observability", "backend"}


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"gradientflow.{name}")
    raise AttributeError(f"module 'gradientflow' has no attribute {name!r}")


__all__ = ["BACKEND_NAME", "Config", "__version__", "configure", "flush", "mark_step",
           "monitored_barrier", "reset_stats", "start_timeline", "stats", "stop_timeline", *_LAZY]
