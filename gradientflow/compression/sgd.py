"""One step's SGD settings for one buffer, as a compressor with momentum correction applies them.

torch.optim.SGD (dampening 0) steps with d = g + wd*p, buf = m*buf + d, then buf (Nesterov:
d + m*buf). Under momentum correction the compressor computes the same velocity before it
sparsifies, so the optimizer steps on what arrives with momentum and weight decay at 0. At
density 1 the average of the ranks' velocities is then SGD's buffer, step for step: the weight
decay is added to each rank's gradient (the parameters are the same on every rank, so the
average gains wd*p once) before the momentum, as SGD adds it.

Leaf module: the settings are read from the optimizer by momentum.py; csc.py applies them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SGDTerms"]


@dataclass(frozen=True)
class SGDTerms:
    """Momentum, Nesterov and weight decay of one step, for one flat buffer.

    Example::

        >>> w = torch.ones(3)
        >>> terms = SGDTerms(momentum=0.9, decay=((0, 3, w, 1e-4),))
        >>> flat = torch.zeros(3); terms.add_decay(flat); flat
        tensor([1.0000e-04, 1.0000e-04, 1.0000e-04])
    """

    momentum: float
    nesterov: bool = False
    # (start, end, values, alpha): flat[start:end] += alpha * values, before the momentum.
    # values are the parameter's (detached) elements in that slice; alpha is the weight decay in
    # the buffer's units (times the loss scale, divided by what the average is multiplied by).
    decay: tuple[tuple[int, int, torch.Tensor, float], ...] = ()

    @property
    def velocity_factor(self) -> float:
        """What the stored velocity is SGD's buffer times: the kernels keep Nesterov's as
        m * buffer (u = (u + g) * m), the plain one as the buffer itself."""
        return float(self.momentum) if self.nesterov else 1.0

    def add_decay(self, flat: torch.Tensor) -> None:
        """Add every slice's alpha * parameter to `flat` (this rank's gradient buffer)."""
        for start, end, values, alpha in self.decay:
            flat[start:end].add_(values.reshape(-1), alpha=alpha)
