"""GradientFlow: a torch.distributed backend for communication-bound data-parallel training.

`import gradientflow` registers the backend (so does torch itself, through the entry point,
in scripts that never import us): `torch.distributed.init_process_group(backend="gradientflow")`.
"""
from gradientflow._registrar import BACKEND_NAME, register as _register

_register()

__version__ = "0.1.0"
__all__ = ["BACKEND_NAME", "__version__"]
