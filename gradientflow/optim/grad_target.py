"""Where a reducer delivers averaged gradients by default: into each parameter's `.grad`."""
from __future__ import annotations

import threading

import torch

__all__ = ["GradTarget"]


class GradTarget:
    """Where averaged gradients go by default: into `p.grad` (None where no rank had one)."""

    def __init__(self, params: list[torch.Tensor], bucket_view: bool) -> None:
        self._params = params
        # A result already sits in its partition's buffer: point the gradient at it.
        self._bucket_view = bucket_view
        # Parameter index -> its whole gradient in a buffer where its row blocks' results lie
        # back to back (the fused path's): a row-split parameter points there too, once every
        # block of it was delivered (blocks: how many; delivered: so far, modulo blocks).
        self.homes: dict[int, torch.Tensor] = {}
        self.blocks: dict[int, int] = {}
        self._delivered: dict[int, int] = {}
        self._lock = threading.Lock()  # held only inside write: it never calls out

    def write(self, seg, value: torch.Tensor, used: bool) -> None:
        """Deliver segment `seg` of parameter seg.index (its average `value`, or unused)."""
        # Partitions complete on the transport's threads, two at a time: the row blocks of one
        # parameter must not both find no buffer and each allocate one (a lost block).
        with self._lock:
            p = self._params[seg.index]
            home = self.homes.get(seg.index) if self._bucket_view else None
            if home is not None:
                # This block's result is already in `home`. Point the gradient there only once
                # every block was delivered: a block not issued yet still copies its gradient
                # from p.grad, and must find the gradient there, not this buffer.
                i = seg.index
                done = self._delivered[i] = (self._delivered.get(i, 0) + 1) % self.blocks[i]
                if done == 0:
                    p.grad = home if used else None
                return
            if not used:
                p.grad = None  # no rank had a gradient: leave it alone, as DDP does
                return
            if seg.whole and not value.is_sparse and self._bucket_view:
                # The result already sits in this partition's buffer: point the gradient at it
                # instead of copying it back (DDP's gradient_as_bucket_view). The buffer is
                # reused next step, after zero_grad(); a zero_grad(set_to_none=False) zeroes it
                # in place and backward accumulates into it, which the next fill then finds.
                p.grad = value
                return
            if p.grad is None or p.grad.is_sparse:
                p.grad = torch.zeros_like(p)
            seg.view(p.grad).copy_(value)

    def write_sparse(self, index: int, value: torch.Tensor | None) -> None:
        """Deliver a sparse parameter's coalesced sum (None: no rank had a gradient)."""
        self._params[index].grad = value
