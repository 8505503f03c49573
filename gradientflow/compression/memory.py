"""Error-feedback memory: per-parameter state kept flat per bucket layout, keyed by parameter NAME.

Why names: DDP rebuilds its buckets after the first iteration, and a DDP resumed from a
checkpoint starts from its *first* layout again (PyTorch PR #48670), so state keyed by bucket
index lands on the wrong parameters. Here each layout owns one flat tensor per slot (so the
kernels read it in one pass, like the gradient); when a new layout appears, every parameter's
slice is moved over from wherever it lives now (or from a loaded checkpoint), once.

Loss scaling: stored values are in the units of the loss scale they were produced under
(`scale`). When the compressor is told a new scale, a layout's buffers are multiplied by
new/old once, on first use: no per-step cost, and a residual produced under one scale is never
added to gradients of another. `state_dict()` stores them unscaled.

Double buffer or in place: by default every state slot has a spare ("_residual_spare" beside
"residual") that a step writes and `commit` swaps in, so a batch that fails, or a step that
GradScaler skips, leaves the state as it was. Where neither can happen (the FSDP2 path: no loss
scale, each reduction run to its end on the caller's thread) `double_buffer=False` drops the
spare: a spare slot's name then returns its live tensor, the step updates it in place, and one
copy of the state is kept instead of two. A step found non-finite there cannot be undone; its
non-finite elements are zeroed (`end_step(revert=True)`), so one overflow does not poison every
later step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .layout import Layout

__all__ = ["ResidualMemory"]


def _live_of(slot: str) -> str:
    """The live slot a spare slot "_NAME_spare" stands beside ("" for any other slot)."""
    if slot.startswith("_") and slot.endswith("_spare"):
        return slot[1:-len("_spare")]
    return ""


@dataclass
class _Entry:
    slots: dict[str, torch.Tensor]
    scale: float
    live: set[str] = field(default_factory=set)  # names whose state still lives here


class ResidualMemory:
    """Hold flat per-layout state tensors (residual, momentum, ...) whose identity is the parameter
    name.

    Slots whose name starts with "_" are scratch (e.g. a double buffer) and never checkpointed.
    With ``double_buffer=False`` a spare slot "_NAME_spare" is slot NAME itself (the module
    docstring says where that is safe).
    """

    def __init__(self, double_buffer: bool = True) -> None:
        self.double_buffer = double_buffer
        self._entries: dict[Layout, _Entry] = {}
        self._owner: dict[str, Layout] = {}
        # slot -> name -> unscaled tensor, loaded from a checkpoint and not yet claimed by a layout.
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        # Swaps committed during the current step, undone if the step turns out non-finite.
        self._journal: list[tuple[Layout, tuple[tuple[str, str], ...]]] = []

    # --- use -------------------------------------------------------------------------------------
    def get(
        self, layout: Layout, slots: tuple[str, ...], like: torch.Tensor, scale: float = 1.0
    ) -> dict[str, torch.Tensor]:
        """Return this layout's flat state tensors (creating, re-laying out or rescaling as
        needed)."""
        entry = self._entries.get(layout)
        if entry is None:
            entry = self._build(layout, self._own(slots), like, scale)
        for slot in self._own(slots):
            if slot not in entry.slots:
                entry.slots[slot] = torch.zeros(
                    layout.numel, dtype=torch.float32, device=like.device
                )
        if entry.scale != scale:
            ratio = float(scale) / float(entry.scale)
            for t in entry.slots.values():
                t.mul_(ratio)
            entry.scale = float(scale)
        if self.double_buffer:
            return entry.slots
        return {**entry.slots, **{s: entry.slots[_live_of(s)] for s in slots if _live_of(s)}}

    def _own(self, slots: tuple[str, ...]) -> tuple[str, ...]:
        """The slots that get a tensor of their own (in place: not the spares)."""
        if self.double_buffer:
            return slots
        return tuple(s for s in slots if not _live_of(s))

    def commit(self, layout: Layout, pairs: tuple[tuple[str, str], ...]) -> None:
        """Make each spare slot the live one, (live, spare) -> (spare, live): a double buffer, no
        copy.

        The old values stay in the spare slot until the end of the step, so `end_step(revert=True)`
        can restore them when a LATER bucket of the same step turns out non-finite (GradScaler then
        skips the whole step, so no bucket of it may leave its residual changed).
        """
        s = self._entries[layout].slots
        if self.double_buffer:
            for live, spare in pairs:
                s[live], s[spare] = s[spare], s[live]
        self._journal.append((layout, pairs))

    def end_step(self, revert: bool) -> None:
        """Close a step: keep its commits, or undo all of them (in reverse order) when `revert`.

        In place (no double buffer) nothing can be undone: the non-finite elements of what the
        step wrote are zeroed instead."""
        if revert and not self.double_buffer:
            for layout, pairs in self._journal:
                entry = self._entries.get(layout)
                if entry is None:
                    continue
                for live, _ in pairs:
                    torch.nan_to_num_(entry.slots[live], nan=0.0, posinf=0.0, neginf=0.0)
        elif revert:
            for layout, pairs in reversed(self._journal):
                entry = self._entries.get(layout)
                if entry is None:
                    continue
                for live, spare in pairs:
                    entry.slots[live], entry.slots[spare] = entry.slots[spare], entry.slots[live]
        self._journal.clear()

    def scale_slot(self, slot: str, factor: float) -> None:
        """Multiply one slot of every parameter by `factor` (between steps)."""
        for entry in self._entries.values():
            t = entry.slots.get(slot)
            if t is not None:
                t.mul_(factor)
        for t in self._pending.get(slot, {}).values():
            t.mul_(factor)

    def scale_names(self, slot: str, factors: dict[str, float]) -> None:
        """Multiply one slot of each named parameter by its factor (between steps); a layout
        whose parameters all take one factor in one operation."""
        for layout, entry in self._entries.items():
            t = entry.slots.get(slot)
            if t is None:
                continue
            mine = {factors.get(n) for n in layout.names if n in entry.live}
            if len(mine) == 1 and None not in mine and len(entry.live) == len(layout.names):
                t.mul_(mine.pop())
                continue
            for name, start, end in layout.slices():
                f = factors.get(name)
                if f is not None and name in entry.live:
                    t[start:end].mul_(f)
        for name, t in self._pending.get(slot, {}).items():
            f = factors.get(name)
            if f is not None:
                t.mul_(f)

    def put(self, slot: str, per_name: dict[str, torch.Tensor]) -> None:
        """Set one slot of the named parameters to unscaled values (between steps): into the
        layout that holds a parameter now, or kept until one claims it."""
        for name, value in per_name.items():
            layout = self._owner.get(name)
            entry = self._entries.get(layout) if layout is not None else None
            if entry is None or name not in entry.live:
                self._pending.setdefault(slot, {})[name] = value.detach().clone().float()
                continue
            i = layout.names.index(name)
            start, n = layout.offsets[i], layout.numels[i]
            if value.numel() != n:
                raise ValueError(f"ResidualMemory: the {slot} given for parameter {name!r} has "
                                 f"{value.numel()} elements but the parameter has {n}")
            if slot not in entry.slots:
                entry.slots[slot] = torch.zeros(layout.numel, dtype=torch.float32,
                                                device=entry.slots[next(iter(entry.slots))].device)
            entry.slots[slot][start:start + n].copy_(value.reshape(-1)).mul_(entry.scale)

    def _build(
        self, layout: Layout, slots: tuple[str, ...], like: torch.Tensor, scale: float
    ) -> _Entry:
        bufs = {
            s: torch.zeros(layout.numel, dtype=torch.float32, device=like.device) for s in slots
        }
        entry = _Entry(bufs, float(scale), set(layout.names))
        for name, start, end in layout.slices():
            old_layout = self._owner.get(name)
            if old_layout is not None:
                old = self._entries[old_layout]
                o_start = old_layout.offsets[old_layout.names.index(name)]
                ratio = float(scale) / old.scale
                for slot, t in old.slots.items():
                    if slot not in bufs:
                        bufs[slot] = torch.zeros(
                            layout.numel, dtype=torch.float32, device=like.device
                        )
                    bufs[slot][start:end].copy_(t[o_start:o_start + end - start]).mul_(ratio)
                old.live.discard(name)
                if not old.live:
                    del self._entries[old_layout]  # every parameter moved on: free the old buffers
            else:
                for slot, per_name in self._pending.items():
                    saved = per_name.pop(name, None)
                    if saved is None:
                        continue
                    if saved.numel() != end - start:
                        raise ValueError(
                            f"ResidualMemory: the checkpoint's {slot} for parameter {name!r} has "
                            f"{saved.numel()} "
                            f"elements but the parameter has {end - start}; was the model changed?"
                        )
                    if slot not in bufs:
                        bufs[slot] = torch.zeros(
                            layout.numel, dtype=torch.float32, device=like.device
                        )
                    bufs[slot][start:end].copy_(saved.reshape(-1)).mul_(float(scale))
            self._owner[name] = layout
        self._entries[layout] = entry
        return entry

    def nbytes(self) -> int:
        """The bytes of state held (every buffer once, spares and unclaimed checkpoint values
        included)."""
        seen = {id(t): t for e in self._entries.values() for t in e.slots.values()}
        seen.update({id(t): t for d in self._pending.values() for t in d.values()})
        return sum(t.numel() * t.element_size() for t in seen.values())

    # --- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Return {slot: {parameter name: unscaled tensor of its shape}} (copies; scratch slots left
        out)."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for slot, per_name in self._pending.items():
            for name, t in per_name.items():
                out.setdefault(slot, {})[name] = t.clone()
        for layout, entry in self._entries.items():
            for slot, t in entry.slots.items():
                if slot.startswith("_"):
                    continue
                d = out.setdefault(slot, {})
                for name, start, end in layout.slices():
                    if name in entry.live:
                        shape = layout.shapes[layout.names.index(name)]
                        d[name] = (t[start:end] / entry.scale).reshape(shape).clone()
        return out

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Replace all state by a checkpoint's; it is placed into layouts as they are first used."""
        self._entries.clear()
        self._owner.clear()
        self._journal.clear()
        self._pending = {slot: {name: t.detach().clone().float() for name, t in per_name.items()}
                         for slot, per_name in state.items()}

    def reset(self) -> None:
        """Forget everything (e.g. after a world-size change with the 'reset' policy)."""
        self.load_state_dict({})
