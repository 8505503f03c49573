"""Next-forward overlap: step() returns at once; each module's update waits for its next forward.

A strategy of the DistributedOptimizer (overlap_next_forward=True). It takes the reducer's
results into buffers of its own (the user's zero_grad() before the next forward must not erase
an update not applied yet), and a module forward pre-hook applies, just before a module's next
forward, the update of the partitions holding its parameters, with the hyperparameters that
were in force at step().
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable

import torch

from gradientflow.optim.gradient_reducer import GradientReducer

__all__ = ["NextForwardOverlap"]


def _update_groups(plan) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Runs of partitions that share parameters (a row-split parameter): (keys, params)."""
    groups: list[tuple[list[int], list[int]]] = []
    for part in plan:
        ps = part.params
        if groups and set(ps) & set(groups[-1][1]):
            groups[-1][0].append(part.key)
            groups[-1][1].extend(i for i in ps if i not in groups[-1][1])
        else:
            groups.append(([part.key], list(ps)))
    return [(tuple(k), tuple(p)) for k, p in groups]


class NextForwardOverlap:
    """Defer each partition's optimizer update to the next forward that uses its parameters.

    Args:
        reducer: the GradientReducer whose results this strategy receives (it becomes its target).
        step_groups: runs the wrapped optimizer's step on the given parameter groups only.
        param_groups: returns the optimizer's parameter groups now.
    """

    def __init__(self, reducer: GradientReducer, step_groups: Callable[[list[dict]], None],
                 param_groups: Callable[[], list[dict]]) -> None:
        self._reducer = reducer
        self._step_groups = step_groups
        self._param_groups = param_groups
        n = len(reducer.params)
        self._reduced: list[torch.Tensor | None] = [None] * n
        self._unused = [False] * n
        self.pending: dict[int, int] = {}  # id(param) -> update group, not applied yet
        self._ugroups = _update_groups(reducer.plan)
        self._snapshot: list[dict] | None = None
        self._futures: dict[int, torch.futures.Future] = {}
        self._lock = threading.Lock()  # held only inside write: it never calls out
        reducer.target = self
        ref = weakref.ref(self)
        self._hook = torch.nn.modules.module.register_module_forward_pre_hook(
            lambda module, args: _forward_pre_hook(ref, module))

    # --- the reducer's target ---------------------------------------------------------------
    def write(self, seg, value: torch.Tensor, used: bool) -> None:
        """Keep segment `seg`'s average in our own buffer until its update is applied."""
        with self._lock:
            i = seg.index
            if self._reduced[i] is None or self._reduced[i].is_sparse:
                self._reduced[i] = torch.zeros_like(self._reducer.params[i])
            seg.view(self._reduced[i]).copy_(value)
            self._unused[i] = not used

    def write_sparse(self, index: int, value: torch.Tensor | None) -> None:
        """Keep a sparse parameter's sum until its update is applied."""
        self._reduced[index] = value
        self._unused[index] = value is None

    # --- the optimizer's side ---------------------------------------------------------------
    def defer(self) -> None:
        """step(): everything is submitted; remember the hyperparameters and return at once."""
        self._snapshot = [{k: v for k, v in g.items() if k != "params"}
                          for g in self._param_groups()]
        params = self._reducer.params
        self.pending = {id(params[i]): u for u, (_, ps) in enumerate(self._ugroups) for i in ps}
        self._futures = self._reducer.take_futures()

    def export_grads(self) -> None:
        """synchronize(): put the averages into p.grad (copies: our buffers are reused)."""
        for i, p in enumerate(self._reducer.params):
            r = self._reduced[i]
            p.grad = None if (self._unused[i] or r is None) else r.clone()

    def _apply(self, u: int) -> None:
        """Wait for update group u's partitions, then step its parameters (main thread)."""
        keys, idxs = self._ugroups[u]
        for k in keys:
            fut = self._futures.pop(k, None)
            if fut is not None:
                try:
                    self._reducer.settle(k, fut)
                except Exception as exc:
                    self.pending.clear()
                    raise self._reducer.failed(k, exc) from exc
        params = [self._reducer.params[i] for i in idxs]
        for p in params:
            self.pending.pop(id(p), None)
        saved = [p.grad for p in params]
        wanted = {id(p) for p in params}
        groups = []
        for gi, g in enumerate(self._param_groups()):
            mine = [p for p in g["params"] if id(p) in wanted]
            if mine:
                groups.append(dict(self._snapshot[gi], params=mine))
        try:
            for i, p in zip(idxs, params):
                p.grad = None if self._unused[i] else self._reduced[i]
            with torch.no_grad():
                self._step_groups(groups)
        finally:
            for p, g in zip(params, saved):
                p.grad = g

    def finish(self) -> None:
        """Apply every update an overlapped step left pending (in priority order)."""
        if self.pending:
            for u in sorted(set(self.pending.values())):
                if any(id(self._reducer.params[i]) in self.pending for i in self._ugroups[u][1]):
                    self._apply(u)
        if self._futures:
            for k, fut in list(self._futures.items()):
                self._reducer.settle(k, fut)
            self._futures.clear()
        if not self._reducer.futures:
            self._reducer.end_step()

    def forward_pre(self, module: torch.nn.Module) -> None:
        """Apply the pending updates of `module`'s own parameters before its forward."""
        for p in module._parameters.values():
            if p is not None:
                u = self.pending.get(id(p))
                if u is not None:
                    self._apply(u)
        if not self.pending and not self._reducer.futures:
            self._reducer.end_step()

    def wait_in_flight(self) -> None:
        """Wait for partitions still reading gradients (before they are zeroed in place)."""
        for fut in self._futures.values():
            fut.wait()

    def close(self) -> None:
        """Remove the forward pre-hook."""
        self._hook.remove()


def _forward_pre_hook(ref, module) -> None:
    overlap = ref()
    if overlap is not None and overlap.pending:
        overlap.forward_pre(module)
