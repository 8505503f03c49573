"""hvd.init() and the job's shape (size, rank, local and cross ranks), on torch.distributed.

`init()` joins the job torchrun, `gradientflow-run`, pyspark's TorchDistributor or Ray Train
started (a process group from the env:// rendezvous, backend "gradientflow"), adopts a process
group the caller already made, or, run as a plain `python script.py`, makes a job of one
process. Local and cross ranks come from the hosts' names, gathered once at init, as Horovod
derives them from the hosts its launcher placed ranks on.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["HorovodInternalError", "ProcessSet", "global_process_set", "add_process_set",
           "remove_process_set", "init", "shutdown", "is_initialized", "size", "rank",
           "local_size", "local_rank", "cross_size", "cross_rank", "is_homogeneous",
           "start_timeline", "stop_timeline",
           "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled",
           "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built"]

_NOT_INIT = "Horovod has not been initialized; use hvd.init()."


class HorovodInternalError(RuntimeError):
    """A collective failed inside the transport (a peer died, a timeout): Horovod's name."""


@dataclass(frozen=True)
class _Topology:
    """Where this process sits: world rank/size and its host's local and cross coordinates."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    homogeneous: bool


class _State:
    """The module's one mutable record: what init() set up, cleared by shutdown()."""

    topo: Optional[_Topology] = None
    owns_group = False  # init() created the default group, so shutdown() destroys it
    next_set_id = 1
    sets: dict = {}  # process_set_id -> ProcessSet


_STATE = _State()


def _topo() -> _Topology:
    if _STATE.topo is None:
        raise ValueError(_NOT_INIT)
    return _STATE.topo


class ProcessSet:
    """A subset of ranks that run collectives together (Horovod's hvd.ProcessSet).

    Build it from a list of global ranks and pass it to hvd.init(process_sets=[...]) or
    hvd.add_process_set(); then pass it as `process_set=` to a collective. Every rank must
    register the same sets in the same order (each is a torch.distributed group).

    Example::

        >>> evens = hvd.ProcessSet([0, 2])
        >>> hvd.init(process_sets=[evens])
        >>> hvd.allreduce(t, process_set=evens)
    """

    process_set_id: Optional[int] = None
    ranks: Optional[list] = None
    mpi_comm = None

    def __init__(self, ranks_or_comm: Sequence[int]) -> None:
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ValueError("ProcessSet should be initialized with a list of process ranks "
                             "(gradientflow has no MPI communicators)") from None
        if any(not isinstance(r, int) or isinstance(r, bool) for r in ranks):
            raise ValueError("ProcessSet should be initialized with a list of process ranks "
                             "or an mpi4py Comm object")
        self.ranks = ranks
        self._group = None  # its torch.distributed group, made when it is registered

    def _invalidate(self) -> None:
        self.process_set_id = None
        self._group = None

    def size(self) -> Optional[int]:
        """Return the number of ranks in the set, or None if it is not registered."""
        if self.process_set_id is None:
            return None
        return len(self.ranks) if self.ranks else size()

    def rank(self) -> Optional[int]:
        """Return this process's rank within the set, or None if it is not registered."""
        if self.process_set_id is None:
            return None
        if self.process_set_id == 0:
            return rank()
        if rank() not in self.ranks:
            raise ValueError("Process is not part of provided process set.")
        return self.ranks.index(rank())

    def included(self) -> Optional[bool]:
        """Return whether this process belongs to the set (None before hvd.init())."""
        if self.ranks is None:
            return None
        return rank() in self.ranks

    def group(self):
        """The torch.distributed group of this set (None: the world group)."""
        if self.process_set_id is None:
            raise ValueError("Process set does not exist or has not been registered.")
        return self._group

    def __str__(self) -> str:
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def _register(ps: ProcessSet) -> ProcessSet:
    world = size()
    bad = [r for r in ps.ranks if not 0 <= r < world]
    if not ps.ranks or bad:
        raise ValueError(f"ProcessSet ranks {ps.ranks} must be a non-empty list of ranks in "
                         f"0..{world - 1}")
    for other in [global_process_set, *_STATE.sets.values()]:
        if other.ranks == ps.ranks:
            raise ValueError(f"Attempted to add a duplicate process set: {ps}")
    # new_group is collective over the WORLD: every rank makes every set, in the same order.
    ps._group = dist.new_group(ranks=ps.ranks, backend=dist.get_backend())
    ps.process_set_id = _STATE.next_set_id
    _STATE.next_set_id += 1
    _STATE.sets[ps.process_set_id] = ps
    return ps


def add_process_set(process_set) -> ProcessSet:
    """Register a process set after init and return it (every rank must call it, in order).

    Unlike Horovod, no HOROVOD_DYNAMIC_PROCESS_SETS=1 is needed.
    """
    _topo()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    return _register(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set; return whether it was registered (the global set never is)."""
    _topo()
    pid = process_set.process_set_id
    if pid in (None, 0) or _STATE.sets.get(pid) is not process_set:
        return False
    del _STATE.sets[pid]
    group = process_set._group
    process_set._invalidate()
    if group is not None:
        dist.destroy_process_group(group)
    return True


def _join_env_rendezvous() -> None:
    """Create the default group from torchrun's env://, or a one-process job without it."""
    try:
        dist.init_process_group(backend="gradientflow")
    except ValueError as exc:
        # torch's env:// rendezvous names the variable it lacks; with no launcher at all
        # (no RANK), a plain `python script.py` runs as Horovod does: one process.
        if "RANK" not in str(exc) or "not set" not in str(exc):
            raise
        dist.init_process_group(backend="gradientflow", store=dist.HashStore(), rank=0,
                                world_size=1)
    _STATE.owns_group = True


def _topology() -> _Topology:
    r, n = dist.get_rank(), dist.get_world_size()
    hosts: list = [None] * n
    dist.all_gather_object(hosts, socket.gethostname())
    order = list(dict.fromkeys(hosts))  # hosts in order of their first rank
    mine = hosts[r]
    local = [i for i, h in enumerate(hosts) if h == mine]
    local_rank = local.index(r)
    # cross: the ranks with my local rank, one per host that has that many ranks
    cross = [i for i, h in enumerate(hosts)
             if [j for j, g in enumerate(hosts) if g == h].index(i) == local_rank]
    counts = {h: hosts.count(h) for h in order}
    return _Topology(r, n, local_rank, len(local), cross.index(r), len(cross),
                     len(set(counts.values())) == 1)


def init(comm=None, process_sets=None) -> None:
    """Initialize: join (or make) the torch.distributed job and register the process sets.

    Args:
        comm: None (every rank of the job). A list of ranks or an MPI communicator is not
            offered: start only the ranks you want, or use a ProcessSet.
        process_sets: None, a list of ProcessSet to register now, or "dynamic" (accepted for
            Horovod scripts; add_process_set works at any time here).

    Under torchrun / gradientflow-run the group uses the gradientflow backend; a group the
    caller made before (any backend) is adopted as is. Calling init() again does nothing.
    """
    if comm is not None:
        raise NotImplementedError("hvd.init(comm=...) is not offered by gradientflow.horovod: "
                                  "launch only the ranks you need, or use hvd.ProcessSet")
    if process_sets is not None and process_sets != "dynamic":
        if isinstance(process_sets, ProcessSet) or any(
                not isinstance(p, ProcessSet) for p in process_sets):
            raise ValueError("process_sets must be a list of hvd.ProcessSet or 'dynamic'")
    if _STATE.topo is None:
        if not dist.is_initialized():
            _join_env_rendezvous()
        _STATE.topo = _topology()
        global_process_set.ranks = list(range(_STATE.topo.size))
    if process_sets not in (None, "dynamic"):
        for ps in process_sets:
            if ps.process_set_id is None:
                _register(ps)


def shutdown() -> None:
    """Forget the job; destroy the process group if init() created it."""
    if _STATE.topo is None:
        return
    for ps in list(_STATE.sets.values()):
        if ps._group is not None and dist.is_initialized():
            dist.destroy_process_group(ps._group)
        ps._invalidate()
    _STATE.sets.clear()
    _STATE.next_set_id = 1
    _STATE.topo = None
    global_process_set.ranks = []
    if _STATE.owns_group and dist.is_initialized():
        dist.destroy_process_group()
    _STATE.owns_group = False


def start_timeline(file_path, mark_cycles=False) -> None:
    """Start writing this rank's Chrome-trace timeline to `file_path` (gradientflow's own).

    mark_cycles is accepted for Horovod's signature; gradientflow's timeline marks its rounds.
    """
    from gradientflow.observability.timeline import start_timeline as _start

    _topo()
    _start(file_path)


def stop_timeline() -> None:
    """Stop the timeline and finish its file."""
    from gradientflow.observability.timeline import stop_timeline as _stop

    _topo()
    _stop()


def is_initialized() -> bool:
    """Return whether hvd.init() ran (and no shutdown() since)."""
    return _STATE.topo is not None


def size() -> int:
    """Return the number of processes in the job."""
    return _topo().size


def rank() -> int:
    """Return this process's rank in the job."""
    return _topo().rank


def local_size() -> int:
    """Return the number of processes on this host."""
    return _topo().local_size


def local_rank() -> int:
    """Return this process's rank among those on its host (use it to pick a GPU)."""
    return _topo().local_rank


def cross_size() -> int:
    """Return the number of hosts that have a process with this process's local rank."""
    return _topo().cross_size


def cross_rank() -> int:
    """Return the rank of this process's host among those hosts."""
    return _topo().cross_rank


def is_homogeneous() -> bool:
    """Return whether every host runs the same number of processes."""
    return _topo().homogeneous


def mpi_built() -> bool:
    """Return False: gradientflow does not use MPI."""
    return False


def mpi_enabled() -> bool:
    """Return False: gradientflow does not use MPI."""
    return False


def mpi_threads_supported() -> bool:
    """Raise as Horovod does without MPI."""
    raise ValueError("Horovod MPI is not enabled; Please make sure it's installed and enabled.")


def gloo_built() -> bool:
    """Return True: CPU tensors travel over gloo."""
    return dist.is_gloo_available()


def gloo_enabled() -> bool:
    """Return whether the job's CPU collectives run over gloo (always, on gradientflow)."""
    return gloo_built()


def nccl_built() -> int:
    """Return a non-zero NCCL version code if CUDA tensors can travel over NCCL, else 0."""
    if not (dist.is_nccl_available() and torch.cuda.is_available()):
        return 0
    major, minor, patch = torch.cuda.nccl.version()[:3]
    return major * 10000 + minor * 100 + patch  # NCCL_VERSION_CODE for NCCL >= 2.9


def ddl_built() -> bool:
    """Return False: no IBM DDL."""
    return False


def ccl_built() -> bool:
    """Return False: no oneCCL."""
    return False


def cuda_built() -> bool:
    """Return whether this torch build has CUDA."""
    return torch.backends.cuda.is_built()


def rocm_built() -> bool:
    """Return whether this torch build is a ROCm build."""
    return torch.version.hip is not None
