"""The gradientflow process-group backend: thin validation over the ordered engine.

A Python subclass of torch's C++ `Backend`, registered per device with extended_api=True.
Each collective is validated, numbered in issue order by the engine and handed to the
transport underneath: PyTorch's own ProcessGroupGloo for CPU tensors, ProcessGroupNCCL for CUDA
tensors (created lazily on first CUDA use, on the same store). We never write sockets.
"""
from __future__ import annotations

import datetime
import os
import threading
from typing import Any, Callable

import torch
from torch._C._distributed_c10d import (
    AllreduceOptions,
    Backend as _CBackend,
    PrefixStore,
    ProcessGroupGloo,
    ReduceOp,
)

from gradientflow import agreement_check
from gradientflow.backend import layouts, p2p
from gradientflow.backend import validate as V
from gradientflow.config import Config, current_overrides
from gradientflow.engine.engine import Engine
from gradientflow.engine.stall import DEFERRED, Inspector, check_world
from gradientflow.engine.work import BothWork, FutureWork

_UNSET = object()
_DEFERRED_AR = "all_reduce" + DEFERRED  # fused path: differs on the wire from an eager one

# Strong references: torch's TORCH_DISTRIBUTED_DEBUG=DETAIL wrapper needs the backend kept
# alive by its creator, and `pg._get_backend()` returns the wrapper then, so this registry is
# how the rest of gradientflow reaches its own backend (by group name).
_BACKENDS: dict[str, "GradientFlowBackend"] = {}
_BACKENDS_LOCK = threading.Lock()


def _make_gloo(store, rank: int, size: int, timeout: datetime.timedelta, prefix: str):
    return ProcessGroupGloo(PrefixStore(prefix, store), rank, size, timeout)


def _make_nccl(store, rank: int, size: int, timeout: datetime.timedelta, prefix: str):
    from torch._C._distributed_c10d import ProcessGroupNCCL

    opts = ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return ProcessGroupNCCL(PrefixStore(prefix, store), rank, size, opts)


def attempt_store(store):
    """The store namespaced by torchrun's restart count: one attempt never reads another's keys.

    Under `torchrun --max-restarts` the agent's store outlives the workers, and a restarted
    attempt gets the same store with the same group name. Without a namespace, gloo's
    rendezvous reads the dead attempt's addresses ("Connection refused" at init), and the
    inspector would adopt the dead attempt's fault. (TORCHELASTIC_RESTART_COUNT is torchrun's,
    read here rather than in gradientflow.config: it is not a gradientflow setting.)
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return PrefixStore(f"gradientflow/attempt{attempt}/", store) if attempt else store


class Transports:
    """The transport process group per device type; CUDA's is created on first use."""

    # Factories are class attributes so tests can substitute fakes for the CUDA path.
    factories: dict[str, Callable[..., Any]] = {"cpu": _make_gloo, "cuda": _make_nccl}

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta,
                 prefix: str = "gradientflow/", connect_cpu: bool = True) -> None:
        self._args = (store, rank, size, timeout)
        self._prefix = prefix
        self._by_type: dict[str, Any] = {}
        self._lock = threading.Lock()
        if connect_cpu:
            self.get(torch.device("cpu"))  # gloo eagerly: connecting it is part of init

    def existing(self, device_type: str) -> Any:
        """The transport for `device_type` if it was created, else None."""
        return self._by_type.get(device_type)

    def get(self, device: torch.device) -> Any:
        """The transport for `device`, created on first use."""
        pg = self._by_type.get(device.type)
        if pg is None:
            with self._lock:
                pg = self._by_type.get(device.type)
                if pg is None:
                    factory = self.factories.get(device.type)
                    if factory is None:
                        raise RuntimeError(f"gradientflow has no transport for {device.type}")
                    pg = factory(*self._args, f"{self._prefix}{device.type}/")
                    self._by_type[device.type] = pg
        return pg

    def created(self) -> list[str]:
        return sorted(self._by_type)

    def shutdown(self) -> None:
        for pg in self._by_type.values():
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass


@layouts.conform  # strided views and sparse COO, as gloo takes them (backend/layouts.py)
class GradientFlowBackend(_CBackend):
    """A torch.distributed backend whose collectives go through one ordered engine."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta,
                 config: Config, group_name: str = "") -> None:
        super().__init__(rank, size)
        self._rank = rank
        self._size = size
        self.config = config
        self.group_name = group_name
        self._timeout = timeout
        self._seq_for_group = 0
        store = attempt_store(store)
        check_world(store, rank, size, timeout.total_seconds())
        # Before any transport: a setting such as debug decides which groups get connected.
        agreement_check.check(store, rank, size, config, timeout.total_seconds())
        self.transports = Transports(store, rank, size, timeout)
        # The solo channel (Engine.on_solo_channel): a second gloo group, connected by every
        # rank at its first solo allreduce, which is the same call on every rank.
        self.solo_transports = Transports(store, rank, size, timeout,
                                          prefix="gradientflow/solo-", connect_cpu=False)
        # A side group for the agreement rounds, so that they never pair with data messages.
        agree = _make_gloo(store, rank, size, timeout, "gradientflow/agree/")
        self._agree = agree
        self.engine = Engine(rank, size, config, timeout.total_seconds(),
                             self.transports.get, agree, name=group_name or "gradientflow")
        # The keyed scheduler is a second ordered stream (see engine/scheduler.py): its own
        # agreement group and its own transports, created on first use by every rank.
        self._store = store
        self._scheduler = None
        self._scheduler_lock = threading.Lock()
        # Check-ins, mismatch detection, the stall inspector (engine/stall.py).
        self.inspector = Inspector(
            rank, size, store, timeout.total_seconds(), config, group_name or "gradientflow",
            on_fault=self._abort,
            make_group=lambda prefix: _make_gloo(store, rank, size, timeout, prefix))
        self._debug_lock = threading.Lock()
        if self.inspector.enabled:
            # The engine's first error (a round, a fused message after a peer died) is named
            # like an eager op's: which rank died or is missing, what differed.
            self.engine.explain = self.inspector.explain_engine

    # ------------------------------------------------------------------ plumbing
    def _get_backend_name(self) -> str:
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

    def scheduler(self):
        """The keyed priority scheduler of this group (created on first call, on every rank)."""
        with self._scheduler_lock:
            if self._scheduler is None:
                from gradientflow.engine.scheduler import KeyedScheduler

                store, rank, size, timeout = (self._store, self._rank, self._size, self._timeout)
                self._sched_agree = _make_gloo(store, rank, size, timeout,
                                               "gradientflow/sched-agree/")
                self._sched_transports = Transports(store, rank, size, timeout,
                                                    prefix="gradientflow/sched-")
                self._scheduler = KeyedScheduler(
                    rank, size, self._sched_agree, self._sched_transports.get,
                    self.config.schedule_credit,
                    timeout.total_seconds(), name=self.group_name or "gradientflow")
            return self._scheduler

    def shutdown(self) -> None:
        """Close the engine (failing queued operations clearly) and the transports."""
        self.inspector.close()
        if self._scheduler is not None:
            self._scheduler.close()
            self._sched_transports.shutdown()
        self.engine.close()
        self.transports.shutdown()
        self.solo_transports.shutdown()
        try:
            self._agree.shutdown()
        except Exception:  # noqa: BLE001
            pass
        with _BACKENDS_LOCK:
            if _BACKENDS.get(self.group_name) is self:
                del _BACKENDS[self.group_name]

    def flush(self) -> None:
        """Agree on every queued allreduce now (a local hint: results never change)."""
        self.engine.flush()

    def _tp(self, device: torch.device):
        return self.transports.get(device)

    def _abort(self, err: BaseException) -> None:
        """The inspector found a fault: fail what is queued and refuse new work with `err`."""
        self.engine.abort(err)

    def _issue(self, name: str, submit: Callable[[], Any], sig: Any, opts: Any,
               device: torch.device, rop: Any = _UNSET,
               pair_bytes: Callable[[], tuple[list, list]] | None = None) -> Any:
        """Submit in sequence order, recording the call for the inspector (and checking it
        first under GRADIENTFLOW_DEBUG); a synchronous CPU call is waited on here, in slices."""
        insp = self.inspector
        if not insp.enabled:
            return submit()
        # Which fields an options type has, cached: a getattr that misses costs microseconds.
        fields = _OPT_FIELDS.get(type(opts))
        if fields is None:
            fields = _OPT_FIELDS[type(opts)] = tuple(
                hasattr(opts, f) for f in ("rootRank", "reduceOp", "asyncOp"))
        root = opts.rootRank if fields[0] else None
        if rop is _UNSET:
            rop = opts.reduceOp if fields[1] else None
        engine = self.engine
        if insp._debug_group is not None:
            with self._debug_lock:  # the debug check and the submission in one order
                insp.debug_check(engine._seq, name, sig, root, rop, pair_bytes)
                with engine._lock:
                    seq = engine._seq
                    work = submit()
                    insp.record(seq, name, sig, root, rop, work)
        else:
            # Reentrant lock: the sequence number read is the one submit() takes, and records
            # happen in sequence order even when several threads issue collectives.
            with engine._lock:
                seq = engine._seq
                work = submit()
                insp.record(seq, name, sig, root, rop, work)
        if isinstance(work, FutureWork):
            insp.attach(work, seq, name)
        elif insp.sliced and fields[2] and not opts.asyncOp and device.type == "cpu":
            insp.wait_sync(work, seq, name)
        return work

    def _eager(self, name: str, device: torch.device, call: Callable[[Any], Any],
               outputs: Any, opts: Any = None, sig: torch.Tensor | None = None,
               pair_bytes: Callable[[], tuple[list, list]] | None = None) -> Any:
        self._seq_for_group += 1
        return self._issue(name, lambda: self.engine.submit_eager(
            name, lambda: call(self._tp(device)), outputs, device), sig, opts, device,
            pair_bytes=pair_bytes)

    # ------------------------------------------------------------------ reductions
    def allreduce(self, tensors, opts=None):
        opts = opts if isinstance(opts, AllreduceOptions) else _allreduce_opts(opts)
        t = V.check_single(self._rank, "all_reduce", tensors)
        rop = opts.reduceOp  # read once: each read of this pybind property costs microseconds
        V.check_reduce(self._rank, "all_reduce", t, rop)
        async_op = getattr(opts, "asyncOp", True)
        engine = self.engine
        nbytes = _nbytes(t)  # both routes below read it: once per call of a per-tensor loop
        if engine.on_solo_channel(t.device, nbytes):
            # Connected here on first use, outside the engine's lock: a rank that arrives first
            # waits for the others, whose engine threads must still run their rounds.
            tp = self.solo_transports.get(t.device)
            self._seq_for_group += 1
            return self._issue("all_reduce", lambda: engine.submit_solo(
                lambda: tp.allreduce(tensors, opts), t), t, opts, t.device, rop)
        if engine.fusable(nbytes, async_op):
            self._seq_for_group += 1
            insp = self.inspector
            if insp.enabled and insp._debug_group is None:
                # _issue's common case, for the call a per-tensor loop makes 161 times a step.
                with engine._lock:
                    seq = engine._seq
                    work = engine.submit_allreduce(t, rop, not async_op)
                    insp.record(seq, _DEFERRED_AR, t, None, rop, work)
                return insp.attach(work, seq, _DEFERRED_AR)
            return self._issue(_DEFERRED_AR, lambda: engine.submit_allreduce(t, rop, not async_op),
                               t, opts, t.device, rop)
        self._seq_for_group += 1
        return self._issue("all_reduce", lambda: self.engine.submit_eager(
            "all_reduce", lambda: self._tp(t.device).allreduce(tensors, opts), tensors,
            t.device),
            t, opts, t.device, rop)

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
        V.check_tensors(self._rank, name, [output, input])
        if input.numel() != output.numel() * self._size or input.dtype != output.dtype:
            raise V.fail(self._rank, name,
                         f"input has {input.numel()} {input.dtype} elements, output "
                         f"{output.numel()} {output.dtype}",
                         f"input must hold world_size ({self._size}) x output.numel() elements "
                         "of the output's dtype")
        V.check_reduce(self._rank, name, output, opts.reduceOp)
        return self._eager(name, output.device,
                           lambda tp: tp._reduce_scatter_base(output, input, opts), [output],
                           opts, output)

    reduce_scatter_single = _reduce_scatter_base

    # ------------------------------------------------------------------ data movement
    def broadcast(self, tensors, opts):
        t = V.check_single(self._rank, "broadcast", tensors)
        V.check_root(self._rank, "broadcast", opts.rootRank, self._size)
        return self._eager("broadcast", t.device, lambda tp: tp.broadcast(tensors, opts), tensors,
                           opts, t)

    def allgather(self, output_tensors, input_tensors, opts=None):
        t = V.check_single(self._rank, "all_gather", input_tensors)
        V.check_rank_list(self._rank, "all_gather", output_tensors, self._size, "tensor_list", t)
        return self._eager("all_gather", t.device,
                           lambda tp: tp.allgather(output_tensors, input_tensors, opts),
                           output_tensors, opts, t)

    def _allgather_base(self, output, input, opts=None):
        name = "all_gather_into_tensor"
        V.check_tensors(self._rank, name, [output, input])
        if output.numel() != input.numel() * self._size or input.dtype != output.dtype:
            raise V.fail(self._rank, name,
                         f"output has {output.numel()} {output.dtype} elements, input "
                         f"{input.numel()} {input.dtype}",
                         f"output must hold world_size ({self._size}) x input.numel() elements "
                         "of the input's dtype")
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
        dev = V.check_tensors(self._rank, "all_gather_into_tensor_coalesced", inputs)
        return self._eager("all_gather_into_tensor_coalesced", dev,
                           lambda tp: tp.allgather_into_tensor_coalesced(outputs, inputs, opts),
                           outputs, opts, inputs[0] if inputs else None)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        dev = V.check_tensors(self._rank, "reduce_scatter_tensor_coalesced", inputs)
        return self._eager("reduce_scatter_tensor_coalesced", dev,
                           lambda tp: tp.reduce_scatter_tensor_coalesced(outputs, inputs, opts),
                           outputs, opts, inputs[0] if inputs else None)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def alltoall(self, output_tensors, input_tensors, opts=None):
        V.check_list_len(self._rank, "all_to_all", output_tensors, self._size, "output_tensor_list")
        V.check_list_len(self._rank, "all_to_all", input_tensors, self._size, "input_tensor_list")
        dev = V.check_tensors(self._rank, "all_to_all", list(input_tensors) + list(output_tensors))
        return self._eager("all_to_all", dev,
                           lambda tp: tp.alltoall(output_tensors, input_tensors, opts),
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
        # everything issued before it (and the deferred allreduces are agreed first). gloo's
        # barrier also waits for the collectives before it on its own group; the solo
        # channel's are on another, so it gets a barrier too (issued first, in its own issue
        # order), and the barrier's Work waits for both.
        cpu = torch.device("cpu")
        solo = self.solo_transports.existing("cpu")
        if solo is None:
            return self._eager("barrier", cpu, lambda tp: tp.barrier(opts), [], opts)
        engine = self.engine

        def submit():
            # On the caller's thread, in issue order (the solo channel's order), after the
            # debug check; nothing is posted on a group that already failed.
            engine._check_usable("barrier")
            first = solo.barrier(opts)
            return BothWork(first, engine.submit_eager(
                "barrier", lambda: self._tp(cpu).barrier(opts), [], cpu))

        self._seq_for_group += 1
        return self._issue("barrier", submit, None, opts, cpu)

    # ------------------------------------------------------------------ point to point
    # Point-to-point operations involve two ranks only, so they take no sequence number
    # (the sequence must be identical on every rank); gloo pairs them by peer and tag.
    def send(self, tensors, dst_rank, tag):
        t = V.check_single(self._rank, "send", tensors)
        V.check_root(self._rank, "send", dst_rank, self._size)
        return self._tp(t.device).send(tensors, dst_rank, tag)

    def recv(self, tensors, src_rank, tag):
        t = V.check_single(self._rank, "recv", tensors)
        V.check_root(self._rank, "recv", src_rank, self._size)
        return self._tp(t.device).recv(tensors, src_rank, tag)

    def recv_anysource(self, tensors, tag):
        raise p2p.recv_anysource_error(self._rank)  # why: backend/p2p.py

    def gather_single(self, output, input, opts):
        raise V.fail(self._rank, "gather_single", "not available on a Python backend in torch 2.14",
                     "use dist.gather with a gather_list")

    def monitored_barrier(self, opts=None, wait_all_ranks=False):
        p2p.monitored_barrier(self, opts, wait_all_ranks)  # gloo's own (backend/p2p.py)


_OPT_FIELDS: dict[type, tuple[bool, bool, bool]] = {}


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
    with _BACKENDS_LOCK:
        _BACKENDS[backend.group_name] = backend
    if config.timeline:
        from gradientflow.observability.timeline import TIMELINE

        if not TIMELINE.recording:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_initialized() else dist_backend_opts.group_rank
            TIMELINE.start(config.timeline, rank=rank)
    return backend


def backend_of(group=None) -> GradientFlowBackend | None:
    """The gradientflow backend of `group` (default: the world group), or None."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    pg = group if group is not None else dist.group.WORLD
    return _BACKENDS.get(str(pg.group_name))
