"""The gradient reducer: averages a list of named parameters' gradients over a group, by partition.

It knows nothing of torch.optim: it is given parameters and names, watches their gradients
(post-accumulate-grad hooks), and delivers each partition's average to a `target` (by default
into `p.grad`; next-forward overlap gives its own buffers). The optimizer wrapper
(optimizer.py) decides when to wait and what to step.

How a step flows:
1. backward: each parameter's hook marks it ready; partitions (see plan.py) are issued in one
   fixed order, backward's (the last partition first; one complete early waits for those
   after it), so every rank issues the same operations in the same order whatever its timing.
   A dense partition is packed into its persistent flat buffer on the hook's thread (already
   divided by the world size for Average, as DDP does) and sent as one asynchronous allreduce
   whose result the gradients then point into (no copy back); the thread that waits for it
   unpacks it, so little Python competes with backward for the GIL. A compressed partition is
   queued as one part of a fused compressor op (as DDP's compressed buckets are: a batch is one
   compressor op, 3 collectives for all its partitions); a partition with a sparse gradient is
   a multi-stage op (backend.api.submit_stages).
2. on a gradientflow group every partition is an operation of the group's one ordered stream
   (the engine): the rounds that agree which operations every rank has issued also take the
   partitions, and among the partitions one round agrees, the one the next forward needs first
   leaves first (priority = position of its first parameter in registration order, our proxy
   for forward order; TicTac's TIC for a chain; fusion.plan_messages). On any other group the
   same operations go to torch.distributed in the same order (compressed and sparse ones
   synchronously, on the thread that issues them); without torch.distributed they are the
   identity of one rank, issued at step().
3. `submit_rest()` issues what backward did not complete (unused parameters: zeros, as DDP's
   find_unused_parameters) and `wait_all()` waits only for what is still in flight.
"""
from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from gradientflow.compression import QueuedBuffer, make_compressor, queue_name, reduce_queued
from gradientflow.backend.api import allreduce_async, submit_part, submit_stages
from gradientflow.optim.grad_target import GradTarget
from gradientflow.optim.plan import ParamSpec, Partition, build_plan
from gradientflow.optim.plan_check import check_same_everywhere
from gradientflow.optim.reducer_options import PREFIX as _PREFIX
from gradientflow.optim.reducer_options import ReduceOp, ReducerOptions
from gradientflow.optim.stages import dense_average, fill_flat, sparse_allgather

__all__ = ["ReduceOp", "ReducerOptions", "GradTarget", "GradientReducer"]


class GradientReducer:
    """Average the gradients of `named` parameters over `process_group`, partition by partition.

    Args:
        named: (name, parameter) pairs of the trainable parameters, in forward order.
        options: a ReducerOptions.
        process_group: the group (None: the world group, or one process without a group).
        before_first_grad: called (under the reducer's lock) when a step's first gradient
            arrives, before anything is submitted (next-forward overlap applies leftovers).
        sgd_terms: for a compressor with momentum correction, returns one partition's
            SGDTerms from its (parameter, segment view) pairs and the scale of its buffer
            (gradient units to buffer units); called on the submitting thread.
    """

    def __init__(self, named: list[tuple[str, torch.Tensor]], options: ReducerOptions,
                 process_group=None, before_first_grad: Callable[[], None] | None = None,
                 sgd_terms: Callable[..., Any] | None = None) -> None:
        self.options = options
        self.process_group = process_group
        initialized = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(process_group) if initialized else 1
        self.rank = dist.get_rank(process_group) if initialized else 0
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        specs = [ParamSpec(n, tuple(p.shape), p.dtype, p.device) for n, p in named]
        self.plan: list[Partition] = build_plan(specs, options.partition_bytes)
        self.compressor = None
        if options.compression is not None:
            for n, p in named:
                if p.dtype != torch.float32:
                    raise ValueError(f"{_PREFIX}: parameter {n!r} is {p.dtype}; compression "
                                     f"{options.compression.method!r} needs float32 gradients "
                                     "(keep FP32 master parameters, or pass compression=None)")
            self.compressor = make_compressor(options.compression, self.world_size)
        self._layouts = [part.layout() for part in self.plan]
        self._parts_of: list[list[int]] = [[] for _ in self.params]
        for part in self.plan:
            for i in part.params:
                self._parts_of[i].append(part.key)
        n = len(self.plan)
        # TicTac: partition k holds the k-th parameters in forward order, so its priority is k
        # (lower leaves first). FIFO carries none: the order they are issued in (backward's),
        # routed as any async allreduce is.
        self.priority: list[int | None] = list(range(n)) if options.priority else [None] * n
        if initialized and self.world_size > 1:
            check_same_everywhere(specs, options, process_group, self.rank, self.world_size)
        # Partitions are issued during backward wherever torch.distributed runs; without it
        # (one process) at step().
        self._live = initialized
        # Dense or compressed, a result sits in its partition's reused buffer: the gradients
        # point into it rather than take a copy (one pass over the model fewer per step).
        self.target: Any = GradTarget(self.params, bucket_view=True)
        self._before_first_grad = before_first_grad
        self._sgd_terms = sgd_terms
        # Compressed partitions go through the engine's fused pipeline, as DDP's compressed
        # buckets do: the partitions queued together are one compressor op (2 collectives for
        # all of them, plus one for the used flags), prepared ahead on the engine thread.
        self._op_name = (queue_name(options.compression, "DistributedOptimizer partition")
                         if self.compressor is not None else "")

        # --- internal, per step ---
        self._lock = threading.Lock()
        self._counts = [0] * len(self.params)  # backward passes seen since the last sync
        self._missing = [set(part.params) for part in self.plan]  # not ready yet, per partition
        self.futures: dict[int, torch.futures.Future] = {}  # issued partitions of this step
        self.launch_log: list[int] = []  # the keys of the last step, in issue order
        self.seen_grads = False  # a hook fired since the last synchronize
        self._sparse = [False] * len(self.params)  # sticky: a sparse gradient was seen
        # sparse_as_dense: parameters whose sparse gradient was densified, made sparse again
        # once averaged (resparsify), so that optimizers that take only sparse gradients
        # (SparseAdam) still can, as Horovod does.
        self.densified: set[int] = set()
        self._buffers: dict[int, torch.Tensor] = {}  # partition key -> its flat buffer
        # Dense partitions in flight: key -> (the StageGen that unpacks its summed buffer, the
        # buffer), run by whoever waits for its future (settle), on the waiting thread.
        self._unpack: dict[int, tuple[Any, torch.Tensor]] = {}
        self.step_open = False  # compressor step not closed yet
        self._next = len(self.plan) - 1  # the next partition to issue (backward's order)
        self._ready: set[int] = set()  # complete partitions waiting for their turn
        self._slices: list[torch.Tensor] = []  # the fused path's buffers (_fused_buffer)
        ref = weakref.ref(self)
        self._hooks = [p.register_post_accumulate_grad_hook(
            functools.partial(_on_grad_hook, ref, i)) for i, p in enumerate(self.params)]

    # ------------------------------------------------------------------ backward side
    def _on_grad(self, i: int) -> None:
        p = self.params[i]
        if p.grad is not None and p.grad.is_sparse:
            if self.options.sparse_as_dense:
                p.grad = p.grad.to_dense()
                self.densified.add(i)
            elif self.compressor is not None:
                raise RuntimeError(f"{_PREFIX}: parameter {self.names[i]!r} has a sparse "
                                   "gradient, which compression cannot take: pass "
                                   "sparse_as_dense=True (or nn.Embedding(sparse=False))")
        with self._lock:
            if not self.seen_grads:
                if self._before_first_grad is not None:
                    self._before_first_grad()
                if self.compressor is not None:
                    self.compressor.check_schedule()  # here, not on the engine's thread
            self.seen_grads = True
            self._counts[i] += 1
            bpps = self.options.backward_passes_per_step
            if self._counts[i] > bpps:
                self._counts[i] -= 1
                raise RuntimeError(
                    f"{_PREFIX}: parameter {self.names[i]!r} got a gradient "
                    f"{self._counts[i] + 1} times, more than backward_passes_per_step="
                    f"{bpps}, before step(): call step() after each backward(), or increase "
                    "backward_passes_per_step to accumulate gradients locally")
            if self._counts[i] < bpps or not self._live:
                return  # without torch.distributed everything waits for step()
            for k in self._parts_of[i]:
                self._missing[k].discard(i)
                if not self._missing[k]:
                    self._ready.add(k)
            while self._next in self._ready:
                self._issue(self._next)

    def _issue(self, k: int) -> None:
        """Issue partition k, the next in backward's order (its gradients as they are now:
        None means no gradient here)."""
        if k == len(self.plan) - 1:
            self.launch_log = []
        part = self.plan[k]
        if self.compressor is not None:
            self.futures[k] = self._issue_compressed(k)
        else:
            dense, sparse = self._grad_inputs(part)
            gen = self._stages(part, dense, sparse)
            if sparse:
                self.futures[k] = submit_stages(self.process_group, ("optim", id(self), k), gen,
                                                part.device, name="optim",
                                                dense_bytes=part.nbytes)
            else:
                # The dense average is one allreduce: packed here (the hook's thread) and sent
                # asynchronously; its result is unpacked by the thread that waits for it, not
                # on a transport's thread, where the Python work of every partition competed
                # with backward for the GIL.
                flat = next(gen)
                self.futures[k] = allreduce_async(self.process_group, flat, self.priority[k])
                self._unpack[k] = (gen, flat)
        self.launch_log.append(k)
        self._ready.discard(k)
        self._next = k - 1

    def _issue_compressed(self, k: int) -> torch.futures.Future:
        """Queue compressed partition k as one part of its fused compressor op.

        Its gradients are copied into its buffer here, on the issuing thread, so a zero_grad()
        while it waits for its batch cannot take them away.
        """
        part = self.plan[k]
        self.step_open = True
        dense, _ = self._grad_inputs(part)
        layout = self._layouts[k]
        pre, _ = self._scales()
        flat = fill_flat([g for g, _ in dense], layout.numels, torch.float32, part.device, 0,
                         buffer=self._fused_buffer(k), scale=pre)
        op = _PartitionOp(self.compressor, flat, layout, [seg for _, seg in dense],
                          [g is not None for g, _ in dense], self._terms(part))
        return submit_part(self.process_group, ("optim", id(self), k), op, self._fuse,
                           part.device, self._op_name, part.nbytes, close=k == 0)

    def _fuse(self, ops: list["_PartitionOp"]):
        """The StageGen of a fused batch of compressed partitions (the engine's fuser): one
        compressor op for all of them, then one stage of every partition's used flags."""
        outs = yield from reduce_queued(ops)
        flags = torch.tensor([u for op in ops for u in op.used], dtype=torch.float32,
                             device=ops[0].flat.device)  # NCCL takes CUDA tensors only
        flags = (yield flags).gt(0).tolist()
        _, post = self._scales()
        off = 0
        for op, out in zip(ops, outs):
            if post != 1.0:
                out.mul_(post)
            self._deliver(op.segs, out, flags[off:off + len(op.used)])
            off += len(op.used)
        return [op.flat for op in ops]

    def _deliver(self, segs, flat: torch.Tensor, used) -> None:
        """Hand each segment's average (back to back in `flat`) to the target."""
        off = 0
        for seg, u in zip(segs, used):
            self.target.write(seg, flat[off:off + seg.numel].view(seg.shape), u)
            off += seg.numel

    def resparsify(self) -> None:
        """Make the averaged gradients of densified parameters sparse again (after wait_all)."""
        for i in self.densified:
            p = self.params[i]
            if p.grad is not None and not p.grad.is_sparse:
                p.grad = p.grad.to_sparse()

    def _grad_inputs(self, part: Partition):
        """Split a partition's segments into dense (gradient view or None) and sparse ones.

        Whether a parameter's gradient is sparse must be the same on every rank (the stages
        differ): it is remembered from the first sparse gradient seen, so an embedding that got
        no gradient on this rank still takes the sparse route if it was sparse before.
        """
        dense, sparse = [], []
        for seg in part.segments:
            g = self.params[seg.index].grad
            if g is not None and g.is_sparse:
                if self.options.sparse_as_dense:
                    g = g.to_dense()
                else:
                    self._sparse[seg.index] = True
            if self._sparse[seg.index]:
                sparse.append(seg)
            else:
                dense.append((None if g is None else seg.view(g), seg))
        return dense, sparse

    @property
    def postscale(self) -> float:
        """What a compressed average is multiplied by to give the op's result: state kept in
        a compressor's buffers (weight decay, velocity) is in gradient units / postscale."""
        return self._scales()[1]

    def _terms(self, part: Partition):
        """The optimizer's SGD settings for partition `part`'s buffer (None without them).

        Weight decay enters the buffer divided by postscale, so the delivered average gains it
        once."""
        if self._sgd_terms is None:
            return None
        with torch.no_grad():
            pairs = [(self.params[s.index], s.view(self.params[s.index])) for s in part.segments]
        return self._sgd_terms(pairs, 1.0 / self.postscale)

    def _scales(self) -> tuple[float, float]:
        f, n = float(self.options.gradient_predivide_factor), self.world_size
        if self.compressor is not None:  # the compressor already divides by n
            return 1.0 / f, f * (n if self.options.op is ReduceOp.Sum else 1)
        if self.options.op is ReduceOp.Sum:
            return 1.0, 1.0
        if f == 1.0:
            # Divide while packing, as DDP does before its allreduce: nothing is left to do on
            # the transport's thread after the sum, and FP16 sums of n ranks cannot overflow.
            return 1.0 / n, 1.0
        return 1.0 / f, f / n

    def _stages(self, part: Partition, dense, sparse):
        """The StageGen of one uncompressed partition: reduce, then write the results.

        The gradients are picked here, on the issuing thread, not inside the generator: a
        multi-stage one starts later, on the engine's thread, after the user may have zeroed
        p.grad (next-forward overlap lets zero_grad() run while partitions are in flight).
        """
        sparse_grads = {seg.index: self.params[seg.index].grad for seg in sparse}
        return self._run_stages(part, dense, sparse, sparse_grads)

    def _fused_buffer(self, k: int) -> torch.Tensor:
        """Partition k's slice of one FP32 buffer holding every partition in key order, so a
        row-split parameter's blocks lie back to back and its gradient can point at them."""
        if not self._slices:
            sizes = [sum(layout.numels) for layout in self._layouts]
            if len({part.device for part in self.plan}) != 1:
                # parameters on several devices: a buffer per partition
                self._slices = [self._buffer(part, n, torch.float32)
                                for part, n in zip(self.plan, sizes)]
                return self._slices[k]
            flat = torch.empty(sum(sizes), dtype=torch.float32, device=self.plan[0].device)
            self._slices = list(flat.split(sizes))
            homes = getattr(self.target, "homes", None)  # only the default target has them
            off = 0
            for part in self.plan:
                for seg in part.segments:
                    if homes is not None and not seg.whole and seg.row0 == 0:
                        p = self.params[seg.index]
                        homes[seg.index] = flat[off:off + p.numel()].view(p.shape)
                        self.target.blocks[seg.index] = len(self._parts_of[seg.index])
                    off += seg.numel
        return self._slices[k]

    def _buffer(self, part: Partition, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Partition `part`'s flat buffer of `numel` elements, allocated on first use."""
        buf = self._buffers.get(part.key)
        if buf is None or buf.numel() != numel or buf.dtype != dtype:
            buf = self._buffers[part.key] = torch.empty(numel, dtype=dtype, device=part.device)
        return buf

    def _run_stages(self, part: Partition, dense, sparse, sparse_grads):
        pre, post = self._scales()
        flat = None
        # One buffer per partition, reused every step (a fresh one costs a page fault per 4 kB
        # of gradient, every step): a partition runs once per step and its results are
        # delivered to the target before its future completes.
        if dense:
            numels = [seg.numel for _, seg in dense]
            gen = dense_average([g for g, _ in dense], numels, part.dtype, part.device, pre, post,
                                buffer=self._buffer(part, sum(numels) + len(numels), part.dtype))
        else:
            gen = None
        if gen is not None:
            flat, used = yield from gen
        else:
            used = []
        self._deliver([seg for _, seg in dense], flat, used)
        for seg in sparse:
            if seg.row0 != 0 and not seg.whole:
                continue  # a row-split sparse parameter travels whole with its first block
            p = self.params[seg.index]
            out = yield from sparse_allgather(sparse_grads[seg.index], tuple(p.shape), p.dtype,
                                              self.rank, self.world_size, pre, post)
            self.target.write_sparse(seg.index, out)
        return flat

    # ------------------------------------------------------------------ step side
    def submit_rest(self) -> None:
        """Issue every partition backward did not complete (in backward's order)."""
        with self._lock:
            if not self.seen_grads:
                raise RuntimeError(
                    f"{_PREFIX}: step() was called without a backward() since the last step: "
                    "there are no gradients to average. Call loss.backward() before step(); to "
                    "step on gradients you already averaged (e.g. clipped after synchronize()), "
                    "call step() inside `with optimizer.skip_synchronize():`")
            while self._next >= 0:
                self._issue(self._next)

    def settle(self, k: int, fut: torch.futures.Future) -> None:
        """Wait for partition k's future; unpack a dense partition's result (this thread)."""
        entry = self._unpack.pop(k, None)
        fut.wait()
        if entry is not None:
            gen, flat = entry
            try:
                gen.send(flat)  # the allreduce summed it in place
            except StopIteration:
                pass
            else:
                raise RuntimeError(f"{_PREFIX}: partition {k}: the dense average asked for a "
                                   "second allreduce")

    def failed(self, k: int, exc: BaseException) -> RuntimeError:
        """The error to raise when partition k failed (naming the rank and the partition)."""
        return RuntimeError(f"{_PREFIX}: rank {self.rank}: partition {k} "
                            f"({self.plan[k].segments[0].name}, ...) failed: {exc}")

    def wait_all(self) -> None:
        """Wait for every partition submitted this step (the first failure is raised)."""
        futs, self.futures = self.futures, {}
        errors = []
        for k in sorted(futs):
            try:
                self.settle(k, futs[k])
            except Exception as exc:  # noqa: BLE001 - the first one is raised below
                errors.append((k, exc))
        if errors:
            k, exc = errors[0]
            raise self.failed(k, exc) from exc

    def take_futures(self) -> dict[int, torch.futures.Future]:
        """Hand this step's futures to the caller (who settles them) and forget them."""
        futs, self.futures = self.futures, {}
        return futs

    def reset_step(self) -> None:
        """Start counting the next step's gradients (after its partitions were submitted)."""
        self._counts = [0] * len(self.params)
        self._missing = [set(part.params) for part in self.plan]
        self.seen_grads = False
        self._next = len(self.plan) - 1
        self._ready.clear()

    def end_step(self) -> None:
        """Close the compressor's step once every partition of it has been reduced."""
        if self.step_open:
            self.step_open = False
            self.compressor.end_step()

    def close(self) -> None:
        """Remove the gradient hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


class _PartitionOp(QueuedBuffer):
    """One compressed partition queued in the engine: its dense segments in `flat`, and which
    of them had a gradient here."""

    __slots__ = ("segs", "used")

    def __init__(self, compressor, flat: torch.Tensor, layout, segs: list, used: list[bool],
                 terms=None):
        super().__init__(compressor, flat, layout, terms=terms)
        self.segs, self.used = segs, used


def _on_grad_hook(ref, i: int, param: torch.Tensor) -> None:
    reducer = ref()
    if reducer is not None:
        reducer._on_grad(i)
