"""Collectives gloo's Python binding lacks, composed from the ones it has.

torch's ProcessGroup hands `allgather_into_tensor_coalesced` and
`reduce_scatter_tensor_coalesced` to the backend: FSDP2 and DTensor issue them, and so does
every functional `all_gather_tensor` and `reduce_scatter_tensor` (torch's C++ functional ops
call the coalesced form with one tensor). gloo implements both in C++, but its Python object
offers neither. Here each is the per-pair operation gloo does offer (`_allgather_base`,
`_reduce_scatter_base`), issued in list order, the same on every rank, inside the call's one
sequence number; the Work completes when every pair did, with the outputs as its value.
The pairs are checked by the backend before this runs, so nothing is sent for a bad call.
"""
from __future__ import annotations

from typing import Any

from torch._C._distributed_c10d import AllgatherOptions, ReduceScatterOptions

from gradientflow.engine.work import AllWork


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
