"""The gradientflow process-group backend: argument checks over the ordered engine.

A Python subclass of torch's C++ `Backend` where torch lets Python construct one (2.14 on),
else of `ProcessGroup` (torch 2.9-2.13: `Backend` has no Python constructor there, and
init_process_group uses a returned ProcessGroup as the group itself). Registered for CPU and
CUDA with extended_api=True.
Each collective is validated here (validate.py) and handed to one engine entry point per
kind: `engine.allreduce` (which routes it), `engine.collective`, `engine.barrier`. The
engine numbers it in issue order and sends it on the transports (transports.py).
Point-to-point operations involve two ranks only and go to the transport directly.
"""
from __future__ import annotations

import datetime
import functools
import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllreduceOptions, Backend as _CBackend, ReduceOp

from gradientflow import settings_check
from gradientflow.algorithms import Algorithms
from gradientflow.backend import composed, layouts, p2p, registry
from gradientflow.backend import validate as V
from gradientflow.backend.transports import (Transports, attempt_store, incarnation_store,
                                             make_gloo)
from gradientflow.config import Config, current_overrides
from gradientflow.engine.engine import Engine
from gradientflow.inspector import Inspector, check_world


def _python_constructible(base: type) -> bool:
    """Whether a Python subclass of torch's C++ class `base` can be constructed here."""
    try:
        type("_Probe", (base,), {})(0, 1)
    except TypeError:  # pybind11: "No constructor defined!"
        return False
    return True


# Chosen by what this torch can do, not by its version number.
BACKEND_BASE: type = _CBackend if _python_constructible(_CBackend) else dist.ProcessGroup
# Where the base is ProcessGroup, the object is the whole group: torch reads our `group_name`
# and has no per-device backend registered (its `pg._get_backend(device)` would raise, so the
# class answers it with itself).
IS_PROCESS_GROUP: bool = BACKEND_BASE is dist.ProcessGroup


@layouts.conform  # strided views and sparse COO, as gloo takes them (backend/layouts.py)
class GradientFlowBackend(BACKEND_BASE):
    """A torch.distributed backend whose collectives go through one ordered engine."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta,
                 config: Config, group_name: str = "") -> None:
        super().__init__(rank, size)
        self._rank = rank
        self._size = size
        self.config = config
        self._group_name = group_name
        self._timeout = timeout
        self._seq_for_group = 0
        store = attempt_store(store)
        check_world(store, rank, size, timeout.total_seconds())
        store = incarnation_store(store, size)
        # Before any transport: a setting such as debug decides which groups get connected.
        settings_check.check(store, rank, size, config, timeout.total_seconds())
        cuda = config.cuda_transport
        self.transports = Transports(store, rank, size, timeout, cuda_transport=cuda)
        # The solo channel (engine/issue.py): a second gloo group, connected here when the
        # channel is on (at a first solo allreduce that another rank issued differently, a
        # connection made then would wait for it in the store, out of reach of any check).
        solo_on = config.solo_channel and config.fusion_threshold > 0 and size > 1
        self.solo_transports = Transports(
            store, rank, size, timeout, prefix="gradientflow/solo-", connect_cpu=solo_on,
            cuda_transport=cuda)
        # A side group for the agreement rounds, so that they never pair with data messages;
        # the solo channel's check rounds get one of their own: on the solo transport they
        # would wait behind the solo data before them, and on this one they would pair with
        # the engine's rounds in an order that differs between ranks.
        agree = make_gloo(store, rank, size, timeout, "gradientflow/agree/")
        self._agree = agree
        self._solo_agree = (make_gloo(store, rank, size, timeout, "gradientflow/solo-agree/")
                            if solo_on else None)
        # Check-ins, mismatch detection, the stall inspector (gradientflow/inspector). Its
        # faults fail the engine; the engine's first error is explained by it (which rank
        # died or is missing, what differed).
        self.inspector = Inspector(
            rank, size, store, timeout.total_seconds(), config, group_name or "gradientflow",
            on_fault=self._abort,
            make_group=lambda prefix: make_gloo(store, rank, size, timeout, prefix))
        # [algorithms] Fused, solo and stage messages are allreduced under the
        # group's algorithm (ring: the transport, bytes counted); subgroups on the same
        # transports.
        self.algorithms = Algorithms(
            config, store, rank, size, timeout.total_seconds(),
            lambda st, dev, r, n, p: Transports.factory(dev, cuda)(st, r, n, timeout, p),
            group_name or "gradientflow")
        self.engine = Engine(rank, size, config, timeout.total_seconds(),
                             self.algorithms.channel("fused", self.transports.get), agree,
                             name=group_name or "gradientflow",
                             solo=self.algorithms.transports("solo", self.solo_transports),
                             inspector=self.inspector, solo_agree_group=self._solo_agree)
        self._store = store  # the group's store, as the transports use it (tests read it)
        self.tuner = None  # gradientflow.autotune's Tuner of this group, if any

    # ------------------------------------------------------------------ plumbing
    @property
    def group_name(self) -> str:
        """The name torch gave this group (the key of backend/registry.py)."""
        return self._group_name

    def _get_backend_name(self) -> str:
        return "gradientflow"

    if IS_PROCESS_GROUP:
        def _get_backend(self, device=None) -> "GradientFlowBackend":
            """The backend serving `device`: this object itself. As the whole group it has no
            per-device backend registered, so torch's own lookup would raise; callers in
            Python (user code, torch.distributed's helpers) get the backend they asked for."""
            return self

    def name(self) -> str:
        return "gradientflow"

    @property
    def supports_coalescing(self) -> bool:
        # Left to the base class, reading it recurses until RecursionError. We issue the
        # operations of batch_isend_irecv one by one (gloo pairs them by peer and tag).
        return False

    def _get_sequence_number_for_group(self) -> int:
        return self._seq_for_group

    def _set_sequence_number_for_group(self, *args) -> None:
        self._seq_for_group = 0

    def shutdown(self) -> None:
        """Close the engine (failing queued operations clearly) and the transports."""
        if self.tuner is not None:
            self.tuner.close()
        self.inspector.close()
        self.engine.close()
        self.transports.shutdown()
        self.solo_transports.shutdown()
        self.algorithms.shutdown()  # [algorithms]
        for side in (self._agree, self._solo_agree):
            try:
                if side is not None:
                    side.shutdown()
            except Exception:  # noqa: BLE001
                pass
        registry.remove(self.group_name, self)

    def flush(self) -> None:
        """Agree on every queued allreduce now (a local hint: results never change)."""
        self.engine.flush()

    def reconfigure(self, config: Config) -> None:
        """Drain the engine and use `config` from the next collective on (engine.reconfigure).

        Every rank must call it at the same point of its collective sequence, with no other
        thread issuing on this group; gradientflow.autotune does so at a step boundary.
        """
        self.engine.drain()
        self.engine.reconfigure(config)
        self.config = config

    def _abort(self, err: BaseException) -> None:
        """The inspector found a fault: fail what is queued and refuse new work with `err`."""
        self.engine.fail(err)

    def _eager(self, name: str, device: torch.device, call: Any, outputs: Any,
               opts: Any = None, sig: torch.Tensor | None = None, pair_bytes: Any = None) -> Any:
        """Any collective but allreduce and barrier: `call(transport)` sends it (engine)."""
        self._seq_for_group += 1
        return self.engine.collective(name, device, call, outputs, opts, sig, pair_bytes)

    def _check_pairs(self, name: str, outputs, inputs, reduce_op=None) -> Any:
        """(output, input) pairs of an all-gather into a tensor (`reduce_op` None) or of a
        reduce-scatter from one: one device, the input's dtype, world_size times the elements
        on the gathered side. Returns the device."""
        if len(outputs) != len(inputs):
            raise V.fail(self._rank, name, f"{len(outputs)} outputs for {len(inputs)} inputs",
                         "pass one output tensor per input tensor")
        dev = V.check_tensors(self._rank, name, list(outputs) + list(inputs))
        n = self._size
        for i, (out, inp) in enumerate(zip(outputs, inputs)):
            big, small, what = (out, inp, "output") if reduce_op is None else (inp, out, "input")
            if big.numel() != small.numel() * n or inp.dtype != out.dtype:
                pair = f"pair {i}: " if len(outputs) > 1 else ""
                raise V.fail(self._rank, name,
                             f"{pair}output has {out.numel()} {out.dtype} elements, input "
                             f"{inp.numel()} {inp.dtype}",
                             f"the {what} must hold world_size ({n}) times the other's elements, "
                             "of one dtype")
            if reduce_op is not None:
                V.check_reduce(self._rank, name, out, reduce_op)
        return dev

    # ------------------------------------------------------------------ reductions
    def allreduce(self, tensors, opts=None, priority: int | None = None):
        """torch's allreduce; `priority`: the optimizer's partition order (Issue.allreduce).
        A synchronous call may return no Work: it is then complete (as NCCL's)."""
        opts = opts if isinstance(opts, AllreduceOptions) else _allreduce_opts(opts)
        t = V.check_single(self._rank, "all_reduce", tensors)
        rop = opts.reduceOp  # read once: each read of this pybind property costs microseconds
        V.check_reduce(self._rank, "all_reduce", t, rop)
        self._seq_for_group += 1
        # The engine routes it (solo channel, fused, eager) from its byte size.
        return self.engine.allreduce(tensors, opts, t, rop, t.numel() * t.element_size(),
                                     getattr(opts, "asyncOp", True), priority)

    def allreduce_coalesced(self, tensors, opts=None):
        dev = V.check_tensors(self._rank, "all_reduce_coalesced", tensors)
        for t in tensors:
            V.check_reduce(self._rank, "all_reduce_coalesced", t, opts.reduceOp)
        return self._eager("all_reduce_coalesced", dev,
                           lambda tp: tp.allreduce_coalesced(tensors, opts), tensors,
                           opts, tensors[0] if tensors else None)

    def reduce(self, tensors, opts):
        t = V.check_single(self._rank, "reduce", tensors)
        V.check_root(self._rank, "reduce", opts.rootRank, self._size)
        V.check_reduce(self._rank, "reduce", t, opts.reduceOp)
        return self._eager("reduce", t.device, lambda tp: tp.reduce(tensors, opts), tensors,
                           opts, t)

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        out = V.check_single(self._rank, "reduce_scatter", output_tensors)
        V.check_rank_list(self._rank, "reduce_scatter", input_tensors, self._size, "input_list",
                          out)
        V.check_reduce(self._rank, "reduce_scatter", out, opts.reduceOp)
        return self._eager("reduce_scatter", out.device,
                           lambda tp: tp.reduce_scatter(output_tensors, input_tensors, opts),
                           output_tensors, opts, out)

    def _reduce_scatter_base(self, output, input, opts):
        name = "reduce_scatter_tensor"
        self._check_pairs(name, [output], [input], opts.reduceOp)
        return self._eager(name, output.device,
                           lambda tp: tp._reduce_scatter_base(output, input, opts), [output],
                           opts, output)

    reduce_scatter_single = _reduce_scatter_base

    # ------------------------------------------------------------------ data movement
    def broadcast(self, tensors, opts):
        t = V.check_single(self._rank, "broadcast", tensors)
        V.check_root(self._rank, "broadcast", opts.rootRank, self._size)
        self._seq_for_group += 1
        return self.engine.broadcast(tensors, opts, t)

    def allgather(self, output_tensors, input_tensors, opts=None):
        t = V.check_single(self._rank, "all_gather", input_tensors)
        V.check_rank_list(self._rank, "all_gather", output_tensors, self._size, "tensor_list", t)
        return self._eager("all_gather", t.device,
                           lambda tp: tp.allgather(output_tensors, input_tensors, opts),
                           output_tensors, opts, t)

    def _allgather_base(self, output, input, opts=None):
        name = "all_gather_into_tensor"
        self._check_pairs(name, [output], [input])
        return self._eager(name, input.device,
                           lambda tp: tp._allgather_base(output, input, opts), [output],
                           opts, input)

    all_gather_single = _allgather_base

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        dev = V.check_tensors(self._rank, "all_gather_coalesced", input_list)
        return self._eager("all_gather_coalesced", dev,
                           lambda tp: tp.allgather_coalesced(output_lists, input_list, opts),
                           output_lists, opts, input_list[0] if input_list else None)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        name = "all_gather_into_tensor_coalesced"
        dev = self._check_pairs(name, outputs, inputs)
        return self._eager(name, dev, lambda tp: composed.allgather_into_tensor_coalesced(
            tp, outputs, inputs, opts), outputs, opts, inputs[0] if inputs else None)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        name = "reduce_scatter_tensor_coalesced"
        dev = self._check_pairs(name, outputs, inputs, opts.reduceOp if opts else ReduceOp.SUM)
        return self._eager(name, dev, lambda tp: composed.reduce_scatter_tensor_coalesced(
            tp, outputs, inputs, opts), outputs, opts, inputs[0] if inputs else None)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def alltoall(self, output_tensors, input_tensors, opts=None):
        V.check_list_len(self._rank, "all_to_all", output_tensors, self._size, "output_tensor_list")
        V.check_list_len(self._rank, "all_to_all", input_tensors, self._size, "input_tensor_list")
        every = list(input_tensors) + list(output_tensors)
        dev = V.check_tensors(self._rank, "all_to_all", every)
        if len({t.dtype for t in every}) > 1:
            raise V.fail(self._rank, "all_to_all", "the tensors have different dtypes",
                         "give every input and output tensor one dtype")
        return self._eager("all_to_all", dev,
                           lambda tp: composed.alltoall(tp, output_tensors, input_tensors, opts),
                           output_tensors, opts,
                           pair_bytes=lambda: ([_nbytes(t) for t in input_tensors],
                                               [_nbytes(t) for t in output_tensors]))

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        name = "all_to_all_single"
        V.check_tensors(self._rank, name, [output, input])
        for label, splits, t in (("output_split_sizes", output_split_sizes, output),
                                 ("input_split_sizes", input_split_sizes, input)):
            if splits and len(splits) != self._size:
                raise V.fail(self._rank, name, f"{label} has {len(splits)} entries",
                             f"pass one split size per rank ({self._size})")
            if splits and sum(splits) != t.shape[0]:
                raise V.fail(self._rank, name,
                             f"{label} sums to {sum(splits)} but the tensor has {t.shape[0]} rows",
                             "make the split sizes add up to the first dimension")
            if not splits and t.shape[0] % self._size:
                raise V.fail(self._rank, name,
                             f"{t.shape[0]} rows cannot be split evenly over {self._size} ranks",
                             f"pass {label} for uneven splits")
        return self._eager(name, input.device,
                           lambda tp: tp.alltoall_base(output, input, output_split_sizes,
                                                       input_split_sizes, opts), [output], opts,
                           pair_bytes=lambda: (self._split_bytes(input, input_split_sizes),
                                               self._split_bytes(output, output_split_sizes)))

    all_to_all_single = alltoall_base

    def _split_bytes(self, t: torch.Tensor, splits) -> list[int]:
        """Bytes of each rank's share of `t` in all_to_all_single (rows, or an even split)."""
        if not splits:
            return [_nbytes(t) // self._size] * self._size
        row = _nbytes(t) // t.shape[0] if t.shape[0] else 0
        return [n * row for n in splits]

    def gather(self, output_tensors, input_tensors, opts):
        t = V.check_single(self._rank, "gather", input_tensors)
        V.check_root(self._rank, "gather", opts.rootRank, self._size)
        if self._rank == opts.rootRank:
            V.check_rank_list(self._rank, "gather", output_tensors, self._size, "gather_list", t)
        return self._eager("gather", t.device,
                           lambda tp: tp.gather(output_tensors, input_tensors, opts),
                           output_tensors, opts, t)

    def scatter(self, output_tensors, input_tensors, opts):
        t = V.check_single(self._rank, "scatter", output_tensors)
        V.check_root(self._rank, "scatter", opts.rootRank, self._size)
        if self._rank == opts.rootRank:
            V.check_rank_list(self._rank, "scatter", input_tensors, self._size, "scatter_list", t)
        return self._eager("scatter", t.device,
                           lambda tp: tp.scatter(output_tensors, input_tensors, opts),
                           output_tensors, opts, t)

    def barrier(self, opts=None):
        # A barrier is a collective like any other: it goes through the sequence, after
        # everything issued before it (and the deferred allreduces are agreed first).
        self._seq_for_group += 1
        return self.engine.barrier(opts)

    # ------------------------------------------------------------------ point to point
    # Point-to-point operations involve two ranks only, so they take no sequence number
    # (the sequence must be identical on every rank); gloo pairs them by peer and tag.
    def send(self, tensors, dst_rank, tag):
        t = V.check_single(self._rank, "send", tensors)
        V.check_root(self._rank, "send", dst_rank, self._size)
        return self.transports.get(t.device).send(tensors, dst_rank, tag)

    def recv(self, tensors, src_rank, tag):
        t = V.check_single(self._rank, "recv", tensors)
        V.check_root(self._rank, "recv", src_rank, self._size)
        return self.transports.get(t.device).recv(tensors, src_rank, tag)

    def recv_anysource(self, tensors, tag):
        if not IS_PROCESS_GROUP:  # torch's Work wrapper hides the sender (backend/p2p.py)
            raise p2p.recv_anysource_error(self._rank)
        # As the whole group, our Work reaches the user unwrapped: gloo's reports its sender.
        t = V.check_single(self._rank, "recv", tensors)
        return self.transports.get(t.device).recv_anysource(tensors, tag)

    def gather_single(self, output, input, opts):
        raise V.fail(self._rank, "gather_single", "not available on a Python backend in torch 2.14",
                     "use dist.gather with a gather_list")

    def monitored_barrier(self, opts=None, wait_all_ranks=False):
        p2p.monitored_barrier(self, opts, wait_all_ranks)  # gloo's own (backend/p2p.py)


def _repeat_first(general: Any) -> Any:
    """The class's `allreduce` (`general`, layouts' wrappers included) behind the engine's
    path for a repeated synchronous call, which checks what it takes and leaves the rest to
    `general` with nothing taken (engine/sync_own.py: repeat)."""

    @functools.wraps(general)
    def allreduce(self, tensors, opts=None, priority: int | None = None):
        if priority is None:
            if opts is not None and self.engine.repeat(tensors, opts):
                self._seq_for_group += 1
                return None  # complete, as a synchronous call of the engine's may return
            return general(self, tensors, opts)
        return general(self, tensors, opts, priority=priority)

    return allreduce


GradientFlowBackend.allreduce = _repeat_first(GradientFlowBackend.allreduce)


def _eager_under_compile(method: Any) -> Any:
    """`method`, run eagerly where torch.compile traces its caller (a graph break).

    As the whole ProcessGroup (torch before 2.14) our methods are called from Python, so
    dynamo would trace into them and fail on the group's attributes; gloo's are C++ and break
    the graph. torch.compiler.disable imports dynamo, so it is applied at the first call.
    """
    disabled = None

    @functools.wraps(method)
    def call(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            disabled = torch.compiler.disable(method)
        return disabled(*args, **kwargs)

    return call


if IS_PROCESS_GROUP:
    for _name, _method in list(vars(GradientFlowBackend).items()):
        if inspect.isfunction(_method) and hasattr(dist.ProcessGroup, _name):
            setattr(GradientFlowBackend, _name, _eager_under_compile(_method))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _allreduce_opts(op) -> AllreduceOptions:
    opts = AllreduceOptions()
    opts.reduceOp = op if op is not None else ReduceOp.SUM
    return opts


def _resolve_config(pg_options: Any) -> Config:
    if pg_options is None:
        return Config.resolve(current_overrides())
    if isinstance(pg_options, Config):
        return pg_options
    if isinstance(pg_options, dict):
        return Config.resolve({**current_overrides(), **pg_options})
    raise TypeError(
        "gradientflow: pg_options must be None, a dict of gradientflow options or a "
        f"gradientflow.Config, not {type(pg_options).__name__}"
    )


def create_backend(dist_backend_opts, pg_options) -> GradientFlowBackend:
    """The creator torch calls for backend="gradientflow" (extended API)."""
    config = _resolve_config(pg_options)
    backend = GradientFlowBackend(
        dist_backend_opts.store, dist_backend_opts.group_rank, dist_backend_opts.group_size,
        dist_backend_opts.timeout, config, str(dist_backend_opts.group_id),
    )
    registry.add(backend.group_name, backend)
    if config.timeline:
        from gradientflow.observability.timeline import TIMELINE

        if not TIMELINE.recording:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_initialized() else dist_backend_opts.group_rank
            TIMELINE.start(config.timeline, rank=rank)
    return backend
