"""Collectives gloo's Python binding lacks, composed from the ones it has.

torch's ProcessGroup hands `allgather_into_tensor_coalesced` and
`reduce_scatter_tensor_coalesced` to the backend: FSDP2 and DTensor issue them, and so does
every functional `all_gather_tensor` and `reduce_scatter_tensor` (torch's C++ functional ops
call the coalesced form with one tensor). gloo implements both in C++, but its Python object
offers neither. Here each is the per-pair operation gloo does offer (`_allgather_base`,
`_reduce_scatter_base`), issued in list order, the same on every rank, inside the call's one
sequence number; the Work completes when every pair did, with the outputs as its value.
The pairs are checked by the backend before this runs, so nothing is sent for a bad call.

`all_to_all` of tensor lists: gloo's own where it has one; the gloo of older torch (2.9) has
none ("Backend gloo does not support alltoall", raised before anything is sent), and there it
is one `alltoall_base` of the flattened lists, whose received parts are copied into the
outputs when it completes.
"""
from __future__ import annotations

from typing import Any

import torch
from torch._C._distributed_c10d import AllgatherOptions, AllToAllOptions, ReduceScatterOptions

from gradientflow.backend.layouts import WriteBackWork
from gradientflow.engine.work import AllWork

_NO_ALLTOALL = "does not support alltoall"
# Whether the transport offers all_to_all of lists: unknown (None) until the first call.
_gloo_alltoall: bool | None = None


def allgather_into_tensor_coalesced(transport: Any, outputs: list, inputs: list,
                                    opts: Any = None) -> AllWork:
    """outputs[i] = every rank's inputs[i], concatenated in rank order; one Work for all."""
    opts = opts if opts is not None else AllgatherOptions()
    return AllWork([transport._allgather_base(out, inp, opts)
                    for out, inp in zip(outputs, inputs)], outputs)


def reduce_scatter_tensor_coalesced(transport: Any, outputs: list, inputs: list,
                                    opts: Any = None) -> AllWork:
    """outputs[i] = this rank's block of inputs[i], reduced over ranks; one Work for all."""
    opts = opts if opts is not None else ReduceScatterOptions()
    return AllWork([transport._reduce_scatter_base(out, inp, opts)
                    for out, inp in zip(outputs, inputs)], outputs)


def alltoall(transport: Any, outputs: list, inputs: list, opts: Any = None) -> Any:
    """outputs[j] = rank j's inputs[this rank]: gloo's all_to_all of lists, or the same as one
    all_to_all_single of the flattened lists where gloo has none (one dtype, checked first)."""
    global _gloo_alltoall
    opts = opts if opts is not None else AllToAllOptions()
    if _gloo_alltoall is not False:
        try:
            work = transport.alltoall(outputs, inputs, opts)
        except RuntimeError as exc:
            if _NO_ALLTOALL not in str(exc):
                raise
            _gloo_alltoall = False
        else:
            _gloo_alltoall = True
            return work
    flat_in = torch.cat([t.reshape(-1) for t in inputs])
    flat_out = flat_in.new_empty(sum(t.numel() for t in outputs))
    work = transport.alltoall_base(flat_out, flat_in, [t.numel() for t in outputs],
                                   [t.numel() for t in inputs], opts)
    parts = flat_out.split([t.numel() for t in outputs])
    return WriteBackWork(work, [(out, part.view(out.shape)) for out, part in zip(outputs, parts)])
