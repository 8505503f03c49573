"""The ordered engine: one per gradientflow process group, a pipeline of four stages.

1. Issue (issue.py, the caller's thread): every collective takes a sequence number in issue
   order, is recorded for the inspector and routed: SOLO (queued for the solo channel, which
   checks and sends it), FUSED (deferred for fusion) or EAGER (checked, then sent in sequence
   order).
2. Agreement (agreement.py, pure; rounds.py runs it on the engine thread): each batch of
   deferred allreduces is closed by one round on a side group. Where a fused message may end
   cannot be decided locally (rank 0 may wait on op 3 right after issuing it while rank 1 has
   issued ops 3-7), so every rank contributes its local frontier and the MIN is the batch end
   on every rank; the cut into messages is then a pure function of the batch
   (fusion.plan_messages): no further talk.
3. Messages (messages.py, the engine thread and the reaper): agreed messages are packed into
   persistent segments (solo tensors go in place) and handed to the transport strictly in the
   agreed order, so every rank pairs the same messages.
4. Completion (completion.py, the reaper and a pool): values written back, Works done, futures
   settled off the transport's threads.

The engine thread (this module) takes one job at a time from the ordered queue (queue.py,
jobs.py). Which calls pay a round follows from the call sequence alone: exactly one round per
batch of deferred ops, and one per other collective, which checks its signature before it is
sent (checks.py; on the caller's thread when the engine is idle). A batch's round is *started*
on each rank for a local reason (a wait, flush(), the threshold, another collective behind the
batch, or a quiet caller), but rounds pair one-to-one across ranks because every rank closes
the same batches; a round whose ranks queued different calls refuses them on every rank.

Entry points (one per operation kind, bound from Issue): `allreduce`, `broadcast`, `collective`,
`barrier`, `stages`; and `flush`, `drain`, `reconfigure`, `abort`, `close`.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Iterator

import torch

from gradientflow.config import Config
from gradientflow import threads
from gradientflow.engine import completion, own_routes, streams
from gradientflow.engine.fusion import FusableOp, Message
from gradientflow.engine.issue import Issue, IssueParts
from gradientflow.engine.jobs import JobParts, StagesBatch
from gradientflow.engine.stages import StagesOp
from gradientflow.engine.messages import Messages
from gradientflow.engine.queue import OrderedQueue
from gradientflow.engine.rounds import Rounds
from gradientflow.errors import EngineError
from gradientflow.observability.stats import GroupStats


class Engine:
    """Sequences every collective of one process group onto its transports, fusing allreduces.

    `transport_for(device)`: the main transport (gloo, NCCL); `agree_group`: the side group of
    the agreement rounds; `solo`: the solo channel's transports (`get(device)`,
    `existing(type)`), None without one; `solo_agree_group`: the side group of the solo
    channel's check rounds; `inspector`: the group's check-ins (its `record`,
    `attach`, `wait_sync`, `debug` and `explain_engine`), None without one.
    """

    def __init__(self, rank: int, world_size: int, config: Config, timeout_s: float,
                 transport_for: Callable[[torch.device], Any], agree_group: Any,
                 name: str = "gradientflow", solo: Any = None, inspector: Any = None,
                 solo_agree_group: Any = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.config = config
        self.timeout_s = timeout_s
        self.transport_for = transport_for
        self.name = name  # the process group's name, for errors and thread names
        self._name = name
        # The engine's state lock (reentrant, so a path that fails the group while holding it
        # cannot deadlock itself), and a condition on it for the engine thread. Hot paths take
        # `lock` directly: `with` on a Condition enters through a Python-level method.
        self.lock = threading.RLock()
        self.cv = threading.Condition(self.lock)
        self._closing = False
        self._error: BaseException | None = None
        self.stats = GroupStats()
        self.streams = streams.EngineStreams()  # CUDA: where this thread packs and unpacks
        self.fused = completion.FusedCompletion()
        self.messages = Messages(config, name, rank, self.cv, transport_for, self.streams,
                                 self.stats, self.fused, self.fail)
        self.queue = OrderedQueue(config, self.messages.acquire, self.messages.busy)
        self.rounds = Rounds(rank, world_size, agree_group, self.stats, name)
        # Turns the engine's first error into the inspector's explanation (which rank is
        # missing or died, what differed).
        self.explain: Callable[[BaseException], BaseException] | None = None
        self._inspector = None
        if inspector is not None and inspector.enabled:
            self.explain = inspector.explain_engine
            self._inspector = inspector
            self.rounds.fault = lambda: inspector.fault
        issue = Issue(IssueParts(rank, world_size, name, self.lock, self.cv, self.queue,
                                 self.messages, self.stats, self.rounds, self,
                                 self.check_usable, self.fail, solo_agree_group),
                      config, transport_for, solo, inspector)
        self.issue = issue
        self.allreduce = issue.allreduce
        self.repeat = issue.repeat
        self.collective = issue.collective
        self.broadcast = issue.broadcast
        self.barrier = issue.barrier
        self.stages = issue.stages
        # What the engine thread's jobs work with (jobs.py), so none of them holds the engine.
        self._parts = JobParts(rank, self.cv, self.queue, self.rounds, self.messages,
                               self.streams, self.stats, transport_for, self._swap,
                               issue.checking, self.fail, self.refuse_batch)
        self._thread = threading.Thread(target=self._main, name=f"{name}-engine", daemon=True)
        self._thread.start()

    def _swap(self, tensor: torch.Tensor) -> bool:
        """A compressed stage's sum, by one exchange where an eager call of its kind takes
        an own route (own_routes.swap_stage); False: the transport's allreduce carries it."""
        return self.issue.own_routes_on and own_routes.swap_stage(
            self.transport_for(tensor.device), tensor, self.rank, self.world_size,
            self.rounds.wait)

    # ------------------------------------------------------------------ callers' side
    def describe(self, seq: int, name: str) -> str:
        return f"rank {self.rank}: {name} (sequence number {seq}) on process group {self._name}"

    def check_not_engine_thread(self, describe: Callable[[], str]) -> None:
        """Refuse a blocking wait on the engine's own thread: it would wait on itself forever.

        `describe` names the op; it is called only for the error (every wait() passes here).
        """
        if threading.current_thread() is self._thread:
            raise RuntimeError(
                f"gradientflow: {describe()}: wait() called on the engine thread, which is the "
                "thread that must complete it (a deadlock). Chain work with Future.then() "
                "instead of waiting inside a stage."
            )

    def check_usable(self, what: str) -> None:
        """Refuse new work on a failed or destroyed group (lock held)."""
        if self._error is not None:
            raise EngineError(
                f"gradientflow: rank {self.rank}: cannot run {what}: the process group "
                f"{self._name} failed earlier and is unusable ({self._error}). Destroy it and "
                "create a new one (or restart the job from a checkpoint)."
            ) from self._error
        if self._closing:
            raise EngineError(
                f"gradientflow: rank {self.rank}: cannot run {what}: the process group "
                f"{self._name} was destroyed. Create a new process group first."
            )

    def future_of(self, op: FusableOp, for_user: bool = False) -> torch.futures.Future | None:
        """The future of fused op `op` (completion.FusedCompletion.future_of)."""
        return self.fused.future_of(op, for_user)

    def want(self, seq: int) -> None:
        """Somebody waits on op `seq`: close its batch soon (a local hint; results never change)."""
        with self.cv:
            if seq > self.queue.wanted_upto:
                self.queue.wanted_upto = seq
                self.cv.notify_all()

    def flush(self) -> None:
        """Agree on everything queued now (a local hint; it never changes any result)."""
        with self.cv:
            self.queue.wanted_upto = max(self.queue.wanted_upto, self.issue.seq - 1)
            self.cv.notify_all()

    @contextlib.contextmanager
    def waited(self) -> Iterator[None]:
        """Allreduces issued inside are agreed as one batch when the block ends, waited on
        (backend.api.waited says what for)."""
        with self.cv:
            self.queue.held += 1
        try:
            yield
        finally:
            with self.cv:
                self.queue.held -= 1
                self.queue.wanted_upto = max(self.queue.wanted_upto, self.issue.seq - 1)
                self.cv.notify_all()

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait until nothing is queued or in flight (everything issued so far is finished).

        Raises the group's error if it failed meanwhile, and EngineError after `timeout_s`
        (default: the group's timeout) naming what is still pending.
        """
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        self.flush()
        with self.cv:
            while True:
                self.check_usable("drain()")
                if self._quiet():
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineError(
                        f"gradientflow: rank {self.rank}: drain() of process group "
                        f"{self._name} timed out after {timeout_s:.0f} s with "
                        f"{len(self.queue.issued)} op(s) unagreed, {len(self.queue.agreed)} "
                        f"agreed and {self.messages.inflight} message(s) in flight: another "
                        "rank has not issued the collectives this rank is waiting for")
                # The solo channel's last Work completes without notifying the engine.
                self.cv.wait(min(left, 0.01))

    def _quiet(self) -> bool:
        """Nothing queued, running or in flight (lock held)."""
        return (self.queue.idle() and not self.queue.busy and not self.queue.floor
                and not self.messages.busy())

    def refuse_batch(self, n: int, err: BaseException, seqs: list | None = None) -> None:
        """A round refused the first `n` queued ops alike on every rank (or, n=0, the eager
        ops `seqs`): fail them with `err`; the group goes on. The inspector forgets them."""
        with self.cv:
            ops = self.queue.refuse(n)
            if self._inspector is not None:
                self._inspector.refuse(seqs if seqs is not None else [op.seq for op in ops])
        fused = [op for op in ops if isinstance(op, FusableOp)]
        if fused:
            self.fused.finish(fused, err)
        staged = [op for op in ops if isinstance(op, StagesOp)]
        if staged:
            StagesBatch(staged).fail(err)

    def reconfigure(self, config: Config) -> None:
        """Use `config` from the next issued collective on (its fusion, routing, cycle time).

        Valid only while the engine is quiet (drain() first), so that no batch or message
        straddles two configurations; raises EngineError otherwise. Every rank must call it
        at the same point of its collective sequence (gradientflow.autotune does, after an
        ordered collective that hands every rank the same `config`), or the ranks route and
        cut the following ops differently.
        """
        with self.cv:
            self.check_usable("reconfigure()")
            if not self._quiet():
                raise EngineError(
                    f"gradientflow: rank {self.rank}: reconfigure() of process group "
                    f"{self._name} while collectives are queued or in flight; call drain() "
                    "first, with no other thread issuing collectives on this group")
            self.config = config
            self.issue.configure(config)
            self.queue.configure(config)
            self.messages.configure(config)

    def fusion_memory_bytes(self) -> int:
        """Bytes held by persistent fusion buffers."""
        return self.messages.memory_bytes

    # ------------------------------------------------------------------ lifecycle
    def close(self, timeout_s: float | None = None) -> None:
        """Stop accepting work; fail what is still queued with a clear error; join the threads."""
        with self.cv:
            if self._closing:
                return
            self._closing = True
            self._fail_queued(EngineError(
                f"gradientflow: rank {self.rank}: the process group {self._name} was destroyed "
                "while this operation was still queued; wait on every Work before "
                "destroy_process_group()"
            ))
            self.cv.notify_all()
        timeout_s = timeout_s if timeout_s is not None else 5.0
        self._thread.join(timeout_s)
        self.issue.close(timeout_s)
        self.messages.close(timeout_s)  # it ends once what is in flight is finished

    def fail(self, exc: BaseException) -> BaseException:
        """Fail the group with `exc` (explained) unless it failed already; return its error."""
        if self._error is None and self.explain is not None:
            try:
                exc = self.explain(exc)
            except Exception:  # noqa: BLE001 - the original error is still worth raising
                pass
        err = exc if isinstance(exc, EngineError) else EngineError(
            f"gradientflow: rank {self.rank}: process group {self._name} failed: {exc}")
        with self.cv:
            # The first error explains the others (a mismatch, then the timeouts it causes).
            if self._error is None:
                self._error = err
            err = self._error
            self._fail_queued(err)
            self.queue.busy = False
            self.cv.notify_all()
        return err

    def _fail_queued(self, err: BaseException) -> None:
        """Complete every op not yet handed to the transport with `err` (lock held)."""
        fused = []
        for item in self.queue.drain():
            if isinstance(item, Message):
                fused.extend(item.ops)
            elif isinstance(item, FusableOp):
                fused.append(item)
            elif isinstance(item, StagesBatch):
                item.fail(err)
            else:
                completion.complete(item.fut, error=err)
        self.fused.finish(fused, err)

    # ------------------------------------------------------------------ engine thread
    def _main(self) -> None:
        queue = self.queue
        while True:
            with self.cv:
                while True:
                    if self._closing and queue.idle():
                        queue.busy = False
                        return
                    job, delay = queue.next_job()
                    if job is not None:
                        break
                    queue.busy = False
                    self.cv.wait(delay)
                queue.busy = True
            try:
                threads.follow_torch_threads()  # a job may run torch ops (a codec's stages)
                job.run(self._parts)
            except BaseException as exc:  # noqa: BLE001 - the engine must fail loudly, not die
                self.fail(exc)
                return
