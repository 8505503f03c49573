"""GradientFlow: a torch.distributed backend for communication-bound data-parallel training.

`import gradientflow` registers the backend (so does torch itself, through the entry point,
in scripts that never import us): `torch.distributed.init_process_group(backend="gradientflow")`.
"""
from gradientflow._registrar import BACKEND_NAME, register as _register
from gradientflow.config import Config, configure
from gradientflow.engine.api import flush

_register()

__version__ = "0.1.0"
__all__ = ["BACKEND_NAME", "Config", "__version__", "configure", "flush"]
