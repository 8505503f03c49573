"""DDP communication hook for coarse-grained sparse communication (CSC), with its state.

Two collectives per bucket (the chunk norms, then the packed chunks), run back to back by the
engine so that buckets never interleave differently on different ranks.
"""
# No `from __future__ import annotations`: DDP compares the hook's return annotation to the real
# torch.futures.Future[torch.Tensor] object, and a string would not match.

import torch

from ._state import CompressionState, compression_hook

__all__ = ["CSCState", "csc_hook"]


class CSCState(CompressionState):
    """Hold CSC's per-rank state: error-feedback residuals by parameter name, warm-up position,
    stats.

    Args:
        process_group: the group to average over (None: the default group).
        config: a CompressionConfig with method "csc"; or leave it None and pass its fields,
            e.g. ``density=0.01, chunk_size=1024, wire_dtype="fp16"``.
        grad_scaler: the GradScaler producing the gradients, if any (residuals are rescaled
            when its scale moves, so they are never weighted by a stale scale).

    Raises:
        ValueError: a field out of range (density outside (0, 1], chunk_size < 1, ...).

    The default recipe: error feedback beside the optimizer's own momentum (pass
    ``optimizer=``: each residual is kept in its learning rate's units; with
    ``momentum_correction=True`` the state applies that SGD's momentum and weight decay, read at
    every step), a dense first warm-up stage counted in steps. With
    ``warmup_unit="epoch"``, call ``state.set_epoch(epoch)`` at the start of every epoch.

    Example::

        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> state = CSCState(None, density=0.01, optimizer=opt)   # applies opt's momentum
        >>> state.bind_parameter_names(model)
        >>> ddp.register_comm_hook(state, csc_hook)
    """

    _method = "csc"


def csc_hook(state: CSCState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Average one bucket by CSC; return a Future of the averaged (sparse) buffer.

    Example::

        >>> ddp.register_comm_hook(CSCState(None, density=0.01), csc_hook)
    """
    if not isinstance(state, CSCState):
        raise TypeError(f"csc_hook: state must be a CSCState, got {type(state).__name__}; "
                        "use compression_hook for a generic CompressionState")
    return compression_hook(state, bucket)
