"""GradientFlow's DDP communication hooks (PyTorch style: a hook function, its state class beside
it).

The one-line common case::

    state = gradientflow.hooks.register(ddp_model, CompressionConfig(density=0.01), optimizer=opt)
    ...
    state.stats(); torch.save(state.gather_state_dict(), path)

The default recipe: error feedback beside the optimizer's own momentum (the residual follows the
bound SGD's learning rates; DGC's momentum correction, where the compressor applies its momentum
and weight decay, is an option), a dense first warm-up stage counted in steps; see
CompressionConfig.
"""
from __future__ import annotations

from ..compression import CompressionConfig, attach_hook, lookup
from ._state import CompressionState, compression_hook
from .csc_hook import CSCState, csc_hook
from .fp16_hook import FP16State, fp16_hook
from .fsdp import FSDPCompressionState, is_fsdp_model, register_fsdp

__all__ = [
    "CompressionState",
    "compression_hook",
    "CSCState",
    "csc_hook",
    "FP16State",
    "fp16_hook",
    "FSDPCompressionState",
    "register",
]

# The built-in methods' own states; a method registered without one gets CompressionState.
attach_hook("csc", CSCState, csc_hook)
attach_hook("fp16", FP16State, fp16_hook)
attach_hook("none", CompressionState, compression_hook)


def register(ddp_model, config: CompressionConfig | None = None, process_group=None, *,
             optimizer=None, grad_scaler=None) -> CompressionState | FSDPCompressionState:
    """Register the hook `config.method` names on a DDP model, with its parameter names bound;
    return the state. A model sharded with `fully_shard` (FSDP2, or HSDP on a 2-D mesh) gets
    compression inside its reductions instead (hooks/fsdp.py) and an FSDPCompressionState.

    Args:
        ddp_model: the DistributedDataParallel model (or a `fully_shard` model).
        config: a CompressionConfig (default: CSC at 1% with the default recipe).
        process_group: the group (default: the DDP model's).
        optimizer: the torch.optim.SGD stepping the model: the residuals follow its learning
            rates. With momentum correction (an option) the compressor applies its momentum and
            weight decay, read from its groups at every step; pass it, or a step that would
            apply either after the compressor raises. CSC refuses an Adam-family optimizer
            (torch.optim.Adam, AdamW and their subclasses) with a ValueError naming what works,
            unless the config has ``allow_adaptive_optimizer=True``: on a transformer with
            AdamW, CSC at 1% ended far above dense (experiments/lm/README.md). With
            ``optimizer=None`` nothing is known of the optimizer and nothing is refused.
        grad_scaler: the GradScaler producing the gradients, if any.

    Raises:
        ValueError: CSC with an Adam-family optimizer and no ``allow_adaptive_optimizer=True``.

    Example::

        >>> opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        >>> state = gradientflow.hooks.register(ddp, CompressionConfig(density=0.01), optimizer=opt)
    """
    config = CompressionConfig() if config is None else config
    if not isinstance(config, CompressionConfig):
        raise TypeError(
            f"register: config must be a CompressionConfig, got {type(config).__name__}"
        )
    if is_fsdp_model(ddp_model):
        return register_fsdp(ddp_model, config, process_group, optimizer=optimizer,
                             grad_scaler=grad_scaler)
    entry = lookup(config.method)
    state_cls, hook = entry.state or CompressionState, entry.hook or compression_hook
    state = state_cls(
        process_group if process_group is not None else getattr(ddp_model, "process_group", None),
        config,
        grad_scaler=grad_scaler,
        optimizer=optimizer,
    )
    state.bind_parameter_names(ddp_model.module)
    ddp_model.register_comm_hook(state, hook)
    return state
