"""Horovod's DistributedOptimizer on GradientFlow: overlap with backward, priority-ordered transfers.

    opt = gradientflow.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters())
    gradientflow.broadcast_parameters(model.state_dict(), root_rank=0)
    gradientflow.broadcast_optimizer_state(opt, root_rank=0)
    for x, y in loader:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

How a step flows (on a gradientflow process group):
1. backward: each parameter's post-accumulate-grad hook marks it ready; a partition (see plan.py)
   whose parameters are all ready is submitted to the group's keyed scheduler at once; a dense
   one is packed into its persistent flat buffer there, on the hook's thread (already divided
   by the world size for Average, as DDP does), and later sent as one asynchronous allreduce
   whose result the gradients then point into (no copy back). The transport's thread only
   counts it done and completes its future; the thread that waits for it (step(), or the next
   forward's pre-hook) unpacks it, so little Python competes with backward for the GIL.
2. the scheduler launches, among the partitions ready on EVERY rank, the one the next forward
   needs first (priority = position of its first parameter in registration order, our proxy for
   forward order; TicTac's TIC for a chain), within a byte credit; so the launch order is the same
   on every rank although readiness timing differs (engine/scheduler.py).
3. step(): submits what backward did not complete (unused parameters: zeros, as DDP's
   find_unused_parameters), waits only for what is still in flight, then the wrapped optimizer's
   step. With overlap_next_forward=True it does not wait at all: each partition's parameters are
   updated just before the next forward first uses them (a module forward pre-hook waits on that
   module's partitions), with the hyperparameters in force at step().

On any other group (plain gloo, or no torch.distributed at all) nothing is launched during
backward: step() reduces every partition in priority order, synchronously. That static order needs
no agreement, but it is the "no overlap" baseline.
"""
from __future__ import annotations

import contextlib
import enum
import functools
import hashlib
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist

from gradientflow.compression import CompressionConfig, make_compressor
from gradientflow.backend.api import scheduler_of, submit_stages
from gradientflow.engine.scheduler import MAX_KEYS
from gradientflow.optim.plan import ParamSpec, Partition, build_plan
from gradientflow.optim.stages import compressed_average, dense_average, sparse_allgather

__all__ = ["ReduceOp", "Average", "Sum", "DistributedOptimizer", "OptimizerOptions"]

_PREFIX = "gradientflow.DistributedOptimizer"


class ReduceOp(enum.Enum):
    """How gradients are combined across ranks (Horovod's hvd.Average / hvd.Sum)."""

    Average = "average"
    Sum = "sum"


Average = ReduceOp.Average
Sum = ReduceOp.Sum

_COMPRESSION_NAMES = {"none": None, "fp16": "fp16", "csc": "csc"}


@dataclass(frozen=True)
class OptimizerOptions:
    """The validated options of one DistributedOptimizer (fixed for its lifetime)."""

    # --- tuned by the user ---
    compression: CompressionConfig | None  # None: the dense average in the gradients' dtype
    backward_passes_per_step: int = 1
    op: ReduceOp = ReduceOp.Average
    gradient_predivide_factor: float = 1.0
    priority: bool = True  # TicTac order; False: FIFO (the order backward makes them ready)
    # 25 MiB, DDP's bucket size. Each partition costs a message and up to one agreement round
    # (the scheduler batches what becomes ready while a round is in flight; a round costs each
    # rank 0.3-0.7 ms of CPU on two busy cores), so many small partitions cost more than ordering
    # buys (measured with one round per partition ready and per transfer completed): ResNet-50 on 2 ranks at an
    # emulated 10 Gbps stepped in 1089 ms with 1 MiB partitions (136 of them), 639 ms with
    # 8 MiB (18), 571 ms with 25 MiB (5), DDP 489-541 ms (bench_e2e, gf_opt, same runs). A
    # model with few large layers wants smaller partitions for priority to reorder anything
    # (the overlap benchmark uses one per layer).
    partition_bytes: int = 25 << 20
    overlap_next_forward: bool = False
    sparse_as_dense: bool = False

    def __post_init__(self) -> None:
        b = self.backward_passes_per_step
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise ValueError(f"{_PREFIX}: backward_passes_per_step={b!r} must be an integer >= 1")
        if not isinstance(self.op, ReduceOp):
            raise ValueError(f"{_PREFIX}: op={self.op!r} must be gradientflow.Average or "
                             "gradientflow.Sum")
        f = self.gradient_predivide_factor
        if not isinstance(f, (int, float)) or not f > 0:
            raise ValueError(f"{_PREFIX}: gradient_predivide_factor={f!r} must be a number > 0")
        if f != 1.0 and self.op is not ReduceOp.Average:
            raise ValueError(f"{_PREFIX}: gradient_predivide_factor={f} only applies to "
                             "op=Average (as in Horovod); leave it at 1.0 with op=Sum")
        p = self.partition_bytes
        if not isinstance(p, int) or isinstance(p, bool) or p < 1:
            raise ValueError(f"{_PREFIX}: partition_bytes={p!r} must be an integer >= 1 "
                             "(bytes per partition, e.g. 1 << 20)")


def _resolve_compression(compression) -> CompressionConfig | None:
    if compression is None or isinstance(compression, CompressionConfig):
        if isinstance(compression, CompressionConfig) and compression.method == "none":
            return None  # the dense path is the same average, without the float32-only limit
        return compression
    if isinstance(compression, str) and compression in _COMPRESSION_NAMES:
        method = _COMPRESSION_NAMES[compression]
        return None if method is None else CompressionConfig(method=method)
    raise ValueError(f"{_PREFIX}: compression={compression!r} is not understood; pass None, "
                     "'none', 'fp16', 'csc' or a gradientflow.compression.CompressionConfig")


class _DistributedOptimizer:
    """Mixed into the wrapped optimizer's class (as Horovod does), so isinstance and LR
    schedulers keep working; see DistributedOptimizer for the arguments."""

    def __init__(self, params, named_parameters, options: OptimizerOptions,
                 process_group) -> None:
        super().__init__(params)
        self._opts = options
        self._pg = process_group
        initialized = dist.is_available() and dist.is_initialized()
        self._world = dist.get_world_size(process_group) if initialized else 1
        self._rank = dist.get_rank(process_group) if initialized else 0

        all_params = [p for g in self.param_groups for p in g["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
        else:
            named = [(f"allreduce.noname.{i}", p) for i, p in enumerate(all_params)]
        self._check_names(named, all_params)
        # Frozen parameters never get a gradient: they are not part of the plan at all.
        in_opt = {id(p) for p in all_params}
        self._names = [n for n, p in named if p.requires_grad and id(p) in in_opt]
        self._params = [p for n, p in named if p.requires_grad and id(p) in in_opt]
        specs = [ParamSpec(n, tuple(p.shape), p.dtype, p.device)
                 for n, p in zip(self._names, self._params)]
        self._plan: list[Partition] = build_plan(specs, options.partition_bytes)
        if len(self._plan) > MAX_KEYS:
            raise ValueError(f"{_PREFIX}: partition_bytes={options.partition_bytes} cuts the "
                             f"model into {len(self._plan)} partitions, more than the "
                             f"scheduler's {MAX_KEYS}: use a larger partition_bytes")
        self._compressor = None
        if options.compression is not None:
            for n, p in zip(self._names, self._params):
                if p.dtype != torch.float32:
                    raise ValueError(f"{_PREFIX}: parameter {n!r} is {p.dtype}; compression "
                                     f"{options.compression.method!r} needs float32 gradients "
                                     "(keep FP32 master parameters, or pass compression=None)")
            self._compressor = make_compressor(options.compression, self._world)
        self._layouts = [part.layout() for part in self._plan]
        self._parts_of: list[list[int]] = [[] for _ in self._params]
        for part in self._plan:
            for i in part.params:
                self._parts_of[i].append(part.key)
        n = len(self._plan)
        # TicTac: partition k holds the k-th parameters in forward order, so its priority is k
        # (lower runs first). FIFO runs them in the order backward makes them ready: reversed.
        self._priority = list(range(n)) if options.priority else [n - 1 - k for k in range(n)]
        if initialized and self._world > 1:
            self._check_same_everywhere(specs)
        # Every rank calls scheduler_of here, at the same point (it connects a new group).
        self._sched = scheduler_of(process_group) if initialized else None

        # --- internal, per step ---
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # held only inside _write: it never calls out
        self._counts = [0] * len(self._params)  # backward passes seen since the last sync
        self._missing = [set(part.params) for part in self._plan]  # not ready yet, per partition
        self._futs: dict[int, torch.futures.Future] = {}  # submitted partitions of this step
        self._begun = False
        self._seen_grads = False  # a hook fired since the last synchronize
        self._synchronized = False
        self._should_synchronize = True
        # --- next-forward overlap ---
        self._reduced: list[torch.Tensor | None] = [None] * len(self._params)
        self._unused = [False] * len(self._params)
        self._pending: dict[int, int] = {}  # id(param) -> update group, not applied yet
        self._ugroups = self._update_groups()
        self._snapshot: list[dict] | None = None
        self._pending_futs: dict[int, torch.futures.Future] = {}
        self._sparse = [False] * len(self._params)  # sticky: a sparse gradient was seen
        self._buffers: dict[int, torch.Tensor] = {}  # partition key -> its flat buffer
        # Dense partitions in flight: key -> the StageGen that unpacks its summed buffer, run
        # by whoever waits for its future (_settle), on the waiting thread.
        self._unpack: dict[int, Any] = {}
        self._step_open = False  # compressor step not closed yet
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(_on_grad_hook,
                                                                              weakref.ref(self), i))
                       for i, p in enumerate(self._params)]
        if options.overlap_next_forward:
            ref = weakref.ref(self)
            self._hooks.append(torch.nn.modules.module.register_module_forward_pre_hook(
                lambda module, args: _forward_pre_hook(ref, module)))

    # ------------------------------------------------------------------ construction checks
    @staticmethod
    def _check_names(named, all_params) -> None:
        for item in named:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], torch.Tensor)):
                raise ValueError(f"{_PREFIX}: named_parameters must be (name, parameter) pairs, "
                                 f"as model.named_parameters() yields; got {type(item).__name__}")
        names = [n for n, _ in named]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"{_PREFIX}: parameter names {dups[:5]} appear more than once in "
                             "named_parameters; every parameter needs a unique name")
        named_ids = {id(p) for _, p in named}
        unnamed = [i for i, p in enumerate(all_params) if id(p) not in named_ids]
        if unnamed:
            raise ValueError(f"{_PREFIX}: named_parameters was given, but the optimizer's "
                             f"parameters at positions {unnamed[:8]} are not in it; pass "
                             "model.named_parameters() of the model whose parameters the "
                             "optimizer updates")

    def _fingerprint(self, specs) -> str:
        o = self._opts
        h = hashlib.sha256()
        for s in specs:
            h.update(f"{s.name}|{s.shape}|{s.dtype}|".encode())
        h.update(f"{o.partition_bytes}|{o.compression}|{o.backward_passes_per_step}|"
                 f"{o.op}|{o.priority}".encode())
        return h.hexdigest()

    def _check_same_everywhere(self, specs) -> None:
        # One fixed-size allgather of a digest; the detailed (object) gather only on mismatch,
        # which every rank sees at once, so every rank takes the same path.
        digest = self._fingerprint(specs)
        mine = torch.tensor(list(bytes.fromhex(digest)[:16]), dtype=torch.int64)
        out = [torch.zeros_like(mine) for _ in range(self._world)]
        dist.all_gather(out, mine, group=self._pg)
        if all(torch.equal(o, out[0]) for o in out):
            return
        desc = [(s.name, s.shape, str(s.dtype)) for s in specs]
        everyone: list[Any] = [None] * self._world
        dist.all_gather_object(everyone, (desc, repr(self._opts)), group=self._pg)
        detail = ""
        for r, (d, opts) in enumerate(everyone):
            if d != everyone[0][0]:
                k = next((i for i, (a, b) in enumerate(zip(everyone[0][0], d)) if a != b),
                         min(len(d), len(everyone[0][0])))
                a = everyone[0][0][k] if k < len(everyone[0][0]) else "nothing"
                b = d[k] if k < len(d) else "nothing"
                detail = (f"rank 0 has {len(everyone[0][0])} trainable parameters, rank {r} has "
                          f"{len(d)}; first difference at position {k}: rank 0 {a}, rank {r} {b}")
                break
            if opts != everyone[0][1]:
                detail = f"options differ: rank 0 {everyone[0][1]}, rank {r} {opts}"
                break
        raise ValueError(f"{_PREFIX}: rank {self._rank}: the parameter list differs across "
                         f"ranks ({detail}). Build the same model on every rank and pass the "
                         "same named_parameters, in the same order, with the same options, to "
                         "DistributedOptimizer on every rank.")

    def _update_groups(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Runs of partitions that share parameters (a row-split parameter): (keys, params)."""
        groups: list[tuple[list[int], list[int]]] = []
        for part in self._plan:
            ps = part.params
            if groups and set(ps) & set(groups[-1][1]):
                groups[-1][0].append(part.key)
                groups[-1][1].extend(i for i in ps if i not in groups[-1][1])
            else:
                groups.append(([part.key], list(ps)))
        return [(tuple(k), tuple(p)) for k, p in groups]

    # ------------------------------------------------------------------ backward side
    def _on_grad(self, i: int) -> None:
        p = self._params[i]
        if p.grad is not None and p.grad.is_sparse:
            if self._opts.sparse_as_dense:
                p.grad = p.grad.to_dense()
            elif self._compressor is not None:
                raise RuntimeError(f"{_PREFIX}: parameter {self._names[i]!r} has a sparse "
                                   "gradient, which compression cannot take: pass "
                                   "sparse_as_dense=True (or nn.Embedding(sparse=False))")
        with self._lock:
            if not self._seen_grads:
                self._finish_updates()  # a previous overlapped step's leftovers come first
            self._seen_grads = True
            self._synchronized = False
            self._counts[i] += 1
            if self._counts[i] > self._opts.backward_passes_per_step:
                self._counts[i] -= 1
                raise RuntimeError(
                    f"{_PREFIX}: parameter {self._names[i]!r} got a gradient "
                    f"{self._counts[i] + 1} times, more than backward_passes_per_step="
                    f"{self._opts.backward_passes_per_step}, before step(): call step() after "
                    "each backward(), or increase backward_passes_per_step to accumulate "
                    "gradients locally")
            if self._counts[i] < self._opts.backward_passes_per_step or self._sched is None:
                return  # on a non-gradientflow group everything waits for step()
            for k in self._parts_of[i]:
                self._missing[k].discard(i)
                if not self._missing[k] and k not in self._futs:
                    self._submit(k)

    def _submit(self, k: int) -> None:
        """Submit partition k (its gradients as they are now: None means no gradient here)."""
        part = self._plan[k]
        if self._sched is not None and not self._begun:
            self._sched.begin(len(self._plan), self._priority)
            self._begun = True
        dense, sparse = self._grad_inputs(part)
        gen = self._stages(part, dense, sparse)
        if self._sched is not None and self._compressor is None and not sparse:
            # The dense average is one allreduce: packed here (the hook's thread) and sent
            # asynchronously; its result is unpacked by the thread that waits for it (step(),
            # or the next forward's pre-hook), not on the transport's thread, where the Python
            # work of every partition competed with backward for the GIL.
            flat = next(gen)
            fut = self._sched.submit_tensor(k, self._priority[k], flat, part.nbytes)
            self._unpack[k] = gen
        elif self._sched is not None:
            # Compressed and sparse partitions run their stages in sequence, on the scheduler.
            fut = self._sched.submit(k, self._priority[k], gen, part.device, part.nbytes)
        else:
            fut = submit_stages(self._pg, ("optim", id(self), k), gen, part.device,
                                name="optim", dense_bytes=part.nbytes)
        self._futs[k] = fut

    def _grad_inputs(self, part: Partition):
        """Split a partition's segments into dense (gradient view or None) and sparse ones.

        Whether a parameter's gradient is sparse must be the same on every rank (the stages
        differ): it is remembered from the first sparse gradient seen, so an embedding that got
        no gradient on this rank still takes the sparse route if it was sparse before.
        """
        dense, sparse = [], []
        for seg in part.segments:
            g = self._params[seg.index].grad
            if g is not None and g.is_sparse:
                if self._opts.sparse_as_dense:
                    g = g.to_dense()
                else:
                    self._sparse[seg.index] = True
            if self._sparse[seg.index]:
                sparse.append(seg)
            else:
                dense.append((None if g is None else seg.view(g), seg))
        return dense, sparse

    def _scales(self) -> tuple[float, float]:
        f, n = float(self._opts.gradient_predivide_factor), self._world
        if self._compressor is not None:  # the compressor already divides by n
            return 1.0 / f, f * (n if self._opts.op is ReduceOp.Sum else 1)
        if self._opts.op is ReduceOp.Sum:
            return 1.0, 1.0
        if f == 1.0:
            # Divide while packing, as DDP does before its allreduce: nothing is left to do on
            # the transport's thread after the sum, and FP16 sums of n ranks cannot overflow.
            return 1.0 / n, 1.0
        return 1.0 / f, f / n

    def _stages(self, part: Partition, dense, sparse):
        """The StageGen of one partition: reduce, then write the results.

        The gradients are picked here, on the submitting thread, not inside the generator:
        a multi-stage one starts later, on the scheduler's thread, after the user may have
        zeroed p.grad (next-forward overlap lets zero_grad() run while partitions are in flight).
        """
        sparse_grads = {seg.index: self._params[seg.index].grad for seg in sparse}
        return self._run_stages(part, dense, sparse, sparse_grads)

    def _run_stages(self, part: Partition, dense, sparse, sparse_grads):
        pre, post = self._scales()
        flat = None
        if self._compressor is not None and dense:
            gen = compressed_average(self._compressor, self._layouts[part.key],
                                     [g for g, _ in dense], pre, post)
        elif dense:
            numels = [seg.numel for _, seg in dense]
            buf = self._buffers.get(part.key)
            if buf is None or buf.numel() != sum(numels) + len(numels):
                buf = self._buffers[part.key] = torch.empty(sum(numels) + len(numels),
                                                            dtype=part.dtype, device=part.device)
            # One buffer per partition, reused every step: a partition runs once per step and
            # its results are copied out before its future completes.
            gen = dense_average([g for g, _ in dense], numels, part.dtype, part.device, pre, post,
                                buffer=buf)
        else:
            gen = None
        if gen is not None:
            flat, used = yield from gen
        else:
            used = []
        off = 0
        for (_, seg), u in zip(dense, used):
            self._write(seg, flat[off:off + seg.numel].view(seg.shape), u)
            off += seg.numel
        for seg in sparse:
            if self._compressor is not None:
                raise RuntimeError(f"{_PREFIX}: parameter {seg.name!r} has a sparse gradient, "
                                   "which compression cannot take: pass sparse_as_dense=True")
            if seg.row0 != 0 and not seg.whole:
                continue  # a row-split sparse parameter travels whole with its first block
            p = self._params[seg.index]
            out = yield from sparse_allgather(sparse_grads[seg.index], tuple(p.shape), p.dtype, self._rank,
                                              self._world, pre, post)
            if self._opts.overlap_next_forward:
                self._reduced[seg.index] = out
                self._unused[seg.index] = out is None
            else:
                p.grad = out
        return flat

    def _write(self, seg, value: torch.Tensor, used: bool) -> None:
        # Partitions complete on the transport's threads, two at a time: the row blocks of one
        # parameter must not both find no buffer and each allocate one (a lost block).
        with self._write_lock:
            self._write_locked(seg, value, used)

    def _write_locked(self, seg, value: torch.Tensor, used: bool) -> None:
        i = seg.index
        p = self._params[i]
        if self._opts.overlap_next_forward:
            # Into a buffer of our own: the user's zero_grad() before the next forward must not
            # erase an update not applied yet.
            if self._reduced[i] is None or self._reduced[i].is_sparse:
                self._reduced[i] = torch.zeros_like(p)
            seg.view(self._reduced[i]).copy_(value)
            self._unused[i] = not used
            return
        if not used:
            p.grad = None  # no rank had a gradient: leave it alone, as DDP does
            return
        if seg.whole and not value.is_sparse and self._compressor is None:
            # The result already sits in this partition's buffer: point the gradient at it
            # instead of copying it back (DDP's gradient_as_bucket_view). The buffer is reused
            # next step, after zero_grad(); a zero_grad(set_to_none=False) zeroes it in place
            # and backward accumulates into it, which the next fill then finds in place.
            p.grad = value
            return
        if p.grad is None or p.grad.is_sparse:
            p.grad = torch.zeros_like(p)
        seg.view(p.grad).copy_(value)

    # ------------------------------------------------------------------ step side
    def _submit_rest(self) -> None:
        """Submit every partition backward did not complete (static priority order)."""
        with self._lock:
            if not self._seen_grads:
                raise RuntimeError(
                    f"{_PREFIX}: step() was called without a backward() since the last step: "
                    "there are no gradients to average. Call loss.backward() before step(); to "
                    "step on gradients you already averaged (e.g. clipped after synchronize()), "
                    "call step() inside `with optimizer.skip_synchronize():`")
            order = sorted(range(len(self._plan)), key=lambda k: (self._priority[k], k))
            for k in order:
                if k not in self._futs:
                    self._submit(k)

    def _settle(self, k: int, fut: torch.futures.Future) -> None:
        """Wait for partition k's future; unpack a dense partition's result (this thread)."""
        gen = self._unpack.pop(k, None)
        value = fut.wait()
        if gen is not None:
            try:
                gen.send(value)
            except StopIteration:
                pass
            else:
                raise RuntimeError(f"{_PREFIX}: partition {k}: the dense average asked for a "
                                   "second allreduce")

    def _wait_all(self) -> None:
        futs, self._futs = self._futs, {}
        errors = []
        for k in sorted(futs):
            try:
                self._settle(k, futs[k])
            except Exception as exc:  # noqa: BLE001 - the first one is raised below
                errors.append((k, exc))
        if errors:
            k, exc = errors[0]
            raise RuntimeError(f"{_PREFIX}: rank {self._rank}: partition {k} "
                               f"({self._plan[k].segments[0].name}, ...) failed: {exc}") from exc

    def _reset_step(self) -> None:
        self._counts = [0] * len(self._params)
        self._missing = [set(part.params) for part in self._plan]
        self._begun = False
        self._seen_grads = False
        self._step_open = self._compressor is not None

    def _close_compressor_step(self) -> None:
        if self._step_open:
            self._step_open = False
            self._compressor.end_step()

    def synchronize(self) -> None:
        """Wait until every gradient is averaged into p.grad (e.g. to clip it before step())."""
        self._finish_updates()
        self._submit_rest()
        self._wait_all()
        self._reset_step()
        self._close_compressor_step()
        if self._opts.overlap_next_forward:
            for i, p in enumerate(self._params):
                r = self._reduced[i]
                p.grad = None if (self._unused[i] or r is None) else r.clone()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Make step() use p.grad as it is (after synchronize()), without averaging again."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Average what is still in flight, then run the wrapped optimizer's step.

        With a closure (Horovod's contract): the closure is called first, once, with gradients
        enabled; it should zero the gradients, compute the loss and call backward(), which
        launches the averaging as usual. Then the step runs on the averaged gradients and the
        closure's loss is returned. Optimizers that re-evaluate the closure inside their step
        (LBFGS) are not supported: each evaluation would need its own averaging.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._should_synchronize or self._synchronized:
            if self._should_synchronize:
                warnings.warn(f"{_PREFIX}: step() after synchronize() without "
                              "`with optimizer.skip_synchronize():` steps on the gradients "
                              "synchronize() averaged; use the context manager to say so",
                              stacklevel=2)
            self._synchronized = False
            self._base_step(None)
            return loss
        if self._opts.overlap_next_forward:
            self._step_deferred()
            return loss
        self.synchronize()
        self._synchronized = False
        self._base_step(None)
        return loss

    def _base_step(self, closure):
        # The wrapped class's own step, without the optimizer-hook wrapper a second time (our
        # class's step already runs the step hooks once).
        base = super().step
        fn = getattr(base, "__func__", None)
        if fn is not None and getattr(fn, "hooked", False) and hasattr(fn, "__wrapped__"):
            return fn.__wrapped__(self, closure)
        return base(closure)

    def _step_deferred(self) -> None:
        """overlap_next_forward: submit the rest, remember the hyperparameters, return at once."""
        self._finish_updates()
        self._submit_rest()
        self._snapshot = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        self._pending = {id(self._params[i]): u for u, (_, ps) in enumerate(self._ugroups)
                         for i in ps}
        self._pending_futs = dict(self._futs)
        self._futs = {}
        self._reset_step()
        return None

    def _apply(self, u: int) -> None:
        """Wait for update group u's partitions, then step its parameters (main thread)."""
        keys, idxs = self._ugroups[u]
        for k in keys:
            fut = self._pending_futs.pop(k, None)
            if fut is not None:
                try:
                    self._settle(k, fut)
                except Exception as exc:
                    self._pending.clear()
                    raise RuntimeError(f"{_PREFIX}: rank {self._rank}: partition {k} failed: "
                                       f"{exc}") from exc
        params = [self._params[i] for i in idxs]
        for p in params:
            self._pending.pop(id(p), None)
        saved = [p.grad for p in params]
        wanted = {id(p) for p in params}
        groups = []
        for gi, g in enumerate(self.param_groups):
            mine = [p for p in g["params"] if id(p) in wanted]
            if mine:
                groups.append(dict(self._snapshot[gi], params=mine))
        full = self.param_groups
        try:
            for i, p in zip(idxs, params):
                p.grad = None if self._unused[i] else self._reduced[i]
            self.param_groups = groups
            with torch.no_grad():
                self._base_step(None)
        finally:
            self.param_groups = full
            for p, g in zip(params, saved):
                p.grad = g

    def _finish_updates(self) -> None:
        """Apply every update an overlapped step left pending (in priority order)."""
        if self._pending:
            for u in sorted(set(self._pending.values())):
                if any(id(self._params[i]) in self._pending for i in self._ugroups[u][1]):
                    self._apply(u)
        if self._pending_futs:
            for k, fut in list(self._pending_futs.items()):
                self._settle(k, fut)
            self._pending_futs.clear()
        if not self._futs:
            self._close_compressor_step()

    def _forward_pre(self, module: torch.nn.Module) -> None:
        for p in module._parameters.values():
            if p is not None:
                u = self._pending.get(id(p))
                if u is not None:
                    self._apply(u)
        if not self._pending and self._step_open and not self._futs:
            self._close_compressor_step()

    def finish_updates(self) -> None:
        """overlap_next_forward: apply every pending update now (before reading parameters
        outside a forward pass, e.g. to save or compare them)."""
        self._finish_updates()

    # ------------------------------------------------------------------ misuse guards
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Refuse between backward() and step(): the gradients may still be in flight."""
        if self._seen_grads:
            raise RuntimeError(
                f"{_PREFIX}: optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(). This is prohibited: the gradients "
                "are being averaged in the background and would be lost. Call zero_grad() "
                "before the forward pass, or after step()")
        if not set_to_none and self._pending_futs:
            # Zeroing in place would reach gradients a partition still in flight reads from
            # (next-forward overlap): let those finish first. set_to_none=True needs no wait.
            for fut in self._pending_futs.values():
                fut.wait()
        super().zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        """The wrapped optimizer's state dict (after applying any pending overlapped update)."""
        if self._pending:
            self._finish_updates()
        return super().state_dict()

    def close(self) -> None:
        """Remove the gradient and forward hooks (the optimizer stays usable as a local one)."""
        self._finish_updates()
        for h in self._hooks:
            h.remove()
        self._hooks = []

    @property
    def launch_log(self) -> list[int]:
        """The partition keys of the last step in launch order (gradientflow groups only)."""
        return [] if self._sched is None else list(self._sched.launch_log)

    @property
    def plan(self) -> list[Partition]:
        """The partition plan (the same on every rank)."""
        return list(self._plan)


def _on_grad_hook(ref, i: int, param: torch.Tensor) -> None:
    opt = ref()
    if opt is not None:
        opt._on_grad(i)


def _forward_pre_hook(ref, module) -> None:
    opt = ref()
    if opt is not None and opt._pending:
        opt._forward_pre(module)


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                         compression=None, backward_passes_per_step: int = 1,
                         op: ReduceOp = Average, gradient_predivide_factor: float = 1.0,
                         process_group=None, priority: bool = True,
                         partition_bytes: int = 25 << 20, overlap_next_forward: bool = False,
                         sparse_as_dense: bool = False) -> torch.optim.Optimizer:
    """Wrap `optimizer` so that step() applies gradients averaged over every rank (Horovod's API).

    Args:
        optimizer: any torch.optim optimizer; the result is an instance of its class (a
            subclass of it), with the same parameter groups and state.
        named_parameters: model.named_parameters(); names key compression state and errors.
        compression: None/"none" (dense), "fp16", "csc", or a CompressionConfig.
        backward_passes_per_step: backward passes accumulated locally per step (summed, as
            Horovod and DDP's no_sync do; scale the loss yourself for a mean).
        op: gradientflow.Average (default) or gradientflow.Sum.
        gradient_predivide_factor: Average only: scale by 1/f before the sum and f/size after.
        process_group: the group to average over (default: the world group).
        priority: True launches the partition the next forward needs first (TicTac); False
            launches in backward order (FIFO). Both are the same order on every rank.
        partition_bytes: bytes per partition; larger parameters are cut into row blocks.
        overlap_next_forward: step() returns at once; each module's parameters are updated
            just before its next forward (call finish_updates() before reading them otherwise).
        sparse_as_dense: densify sparse gradients (else they are allgathered).

    After step() (dense path), p.grad is a view into a flat buffer that is reused the next step,
    as with DDP's gradient_as_bucket_view: clone it to keep it longer. A parameter no rank gave a
    gradient keeps grad None. optimizer.step(closure) calls the closure once (it runs
    backward), then steps on the averaged gradients.

    Example::

        >>> opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
        ...                            named_parameters=model.named_parameters())
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{_PREFIX}: expected a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError(f"{_PREFIX}: this optimizer is already distributed; wrap the "
                         "original optimizer once")
    options = OptimizerOptions(_resolve_compression(compression), backward_passes_per_step, op,
                               gradient_predivide_factor, bool(priority), partition_bytes,
                               bool(overlap_next_forward), bool(sparse_as_dense))
    base = optimizer.__class__
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": __name__})
    groups = [dict(g) for g in optimizer.param_groups]
    opt = cls(groups, named_parameters, options, process_group)
    opt.defaults = dict(optimizer.defaults)
    if optimizer.state:
        opt.load_state_dict(optimizer.state_dict())
    return opt
