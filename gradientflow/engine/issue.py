"""The front of the engine: every collective is numbered, recorded and routed here, on the
caller's thread.

Sequence numbers follow issue order (the same on every rank: torch.distributed requires it).
Under the engine's lock a call takes its number, goes to the ordered queue (or the transport)
and is recorded for the inspector, so the records keep sequence order under any number of
threads; with GRADIENTFLOW_DEBUG the inspector checks the call on every rank first.

Every call is checked on every rank before its data moves (checks.py): a deferred allreduce
by its batch's round, any other collective by a round of its own on the same side group, in
sequence order (on the caller's thread when the engine is idle, holding the queue's floor so
that no other round or send overlaps it; otherwise on the engine thread, just before it is
sent), solo allreduces by rounds of their own on the solo channel's transport (solo.py). A
call the ranks issued differently is refused on every rank with CollectiveMismatchError, the
group still usable.

Routing of an allreduce, decided only here, from the call alone (so the same on every rank):

- SOLO: on CPU with the solo channel on, at least the solo threshold: queued for the solo
  channel's thread (solo.py), which checks it with the solo calls queued beside it and sends
  it at once over a transport of its own (a second gloo group), where issue order is the
  agreed order. It overtakes the deferred batch before it, which is safe because a rank
  blocked in a wait on an earlier deferred op still takes part in that op's round (the
  engine thread runs it), so no rank waits for a solo that another cannot send.
- FUSED: below the fusion threshold (synchronous calls: below sync_fusion_limit too):
  deferred, sent later fused with its neighbours once a round agreed its batch.
- EAGER: anything else, like every other collective: in sequence order, on the caller's
  thread when nothing is queued (the fast path), else behind what was issued before it;
  in a group of two some go their own ways (own_routes.py), broadcasts too (`broadcast`).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Hashable

import torch

from gradientflow.engine import completion, own_routes, streams
from gradientflow.engine.checks import (Check, broadcast_route, own_route,
                                        refuses_only_the_call, signature)
from gradientflow.engine.fusion import FusableOp, solo_cut
from gradientflow.engine.jobs import Claim, EagerOp
from gradientflow.engine.rounds import Rounds
from gradientflow.engine.solo import SoloChannel, SoloOp
from gradientflow.engine.stages import Fuser, StagesOp, fuse
from gradientflow.engine.sync_own import SyncOwn
from gradientflow.engine.work import AllWork, FusedWork, FutureWork, WorkOwner
from gradientflow.fingerprint import DEFERRED
from gradientflow.observability.stats import GroupStats
from gradientflow.observability.timeline import TIMELINE, now_us

if TYPE_CHECKING:
    from gradientflow.engine.messages import Messages
    from gradientflow.engine.queue import OrderedQueue

SOLO, FUSED, EAGER = "solo", "fused", "eager"
_DEFERRED_AR = "all_reduce" + DEFERRED  # fused path: differs on the wire from an eager one
_UNSET = object()
# Which fields an options type has, cached: a getattr that misses costs microseconds.
_OPT_FIELDS: dict[type, tuple[bool, bool, bool]] = {}


@dataclass(frozen=True, slots=True)
class IssueParts:
    """What the front of the engine works with: the pipeline's parts, not the engine."""

    rank: int
    world_size: int
    name: str  # the process group's, for errors and thread names
    lock: threading.RLock  # the engine's state lock (hot paths take it directly)
    cv: threading.Condition  # on `lock`: wakes the engine thread
    queue: OrderedQueue
    messages: Messages
    stats: GroupStats
    rounds: Rounds  # the engine's: an eager call's round on the caller's thread
    works: WorkOwner  # what the Works handed back ask (the engine)
    check_usable: Callable[[str], None]  # refuses new work on a failed or destroyed group
    fail: Callable[[BaseException], BaseException]  # fails the group; returns its error
    solo_agree_group: Any = None  # the side group of the solo channel's rounds


class Issue:
    """Numbering, inspector records and routing of one engine's collectives."""

    def __init__(self, parts: IssueParts, config: Any,
                 transport_for: Callable[[torch.device], Any], solo: Any,
                 inspector: Any) -> None:
        self._parts = parts
        self._works = parts.works
        self._lock = parts.lock
        self._cv = parts.cv
        self._queue = parts.queue
        self._messages = parts.messages
        self._stats = parts.stats
        self._transport_for = transport_for
        self._solo = solo  # the solo channel's transports (None: no channel)
        self._insp = inspector if inspector is not None and inspector.enabled else None
        self._debug_lock = threading.Lock()  # the debug check and the submission in one order
        self._solo_rounds: Rounds | None = None
        self._solo_ch = SoloChannel(parts.name, self._solo_round, self._solo_sent,
                                    parts.fail, self._refused)
        self.checking: set = set()  # calls in their round right now (their sequence numbers)
        self.seq = 0  # the next sequence number
        if self._insp is not None:
            self._insp.frontier = self.frontier
        self._sync_own = SyncOwn(parts, self._take, self.checking, self._refused,
                                 lambda t: own_routes.swap_add(transport_for(t.device), t,
                                                               parts.rank, parts.rounds.wait),
                                 self._insp, self._sync_route)
        self.repeat = self._sync_own.repeat  # the backend's entry for a repeated sync call
        self.configure(config)

    def configure(self, config: Any) -> None:
        """Take the routing settings of `config` (at creation, or Engine.reconfigure)."""
        self._threshold = config.fusion_threshold
        self._sync_limit = min(config.fusion_threshold, config.sync_fusion_limit)
        self.solo_bytes = solo_cut(config.fusion_threshold, config.solo_threshold)
        self._solo_channel = (self._solo is not None and config.solo_channel
                              and config.fusion_threshold > 0)
        # Eager sums of two ranks go their own ways (checks.own_route) under the ring
        # algorithm, whose result they give; the others are the algorithm's to carry.
        self._own_routes = config.algorithm == "ring"
        self._sync_own.forget()

    @property
    def own_routes_on(self) -> bool:
        """Whether sums of two ranks may take routes of their own (configure)."""
        return self._own_routes

    # ------------------------------------------------------------------ routing
    def route(self, device: torch.device, nbytes: int, async_op: bool = True) -> str:
        """SOLO, FUSED or EAGER for an allreduce of `nbytes` bytes on `device` (module doc).

        Synchronous allreduces are deferred too below `sync_fusion_limit`: PyTorch itself pairs
        a synchronous allreduce on one rank with an asynchronous one on another (Join: a joined
        rank's `all_reduce(zeros(1))` answers the others' async ones), so for small tensors the
        route must not depend on async_op. Larger synchronous ones go eagerly, paying no round
        (they must then be synchronous on every rank).
        """
        if self._solo_channel and nbytes >= self.solo_bytes and device.type == "cpu":
            return SOLO
        return FUSED if nbytes < (self._threshold if async_op else self._sync_limit) else EAGER

    def _sync_route(self, tensors: list, tensor: torch.Tensor, reduce_op: Any) -> int:
        """The own route `allreduce` gives a synchronous call of `tensor`, or 0."""
        nbytes = tensor.numel() * tensor.element_size()
        if not self._own_routes or self.route(tensor.device, nbytes, False) is not EAGER:
            return 0
        return own_route(tensor, reduce_op, self._parts.world_size)

    # ------------------------------------------------------------------ entry points
    def allreduce(self, tensors: list, opts: Any, tensor: torch.Tensor, reduce_op: Any,
                  nbytes: int, async_op: bool, priority: int | None = None) -> Any:
        """An allreduce of `tensor` (`tensors` == [tensor], validated), routed; its Work, or
        None for a synchronous call that completed on the caller's thread (sync_own.py).

        `priority` (the optimizer's partitions): its place among the ops agreed in the same
        round (fusion.plan_messages); such an allreduce is deferred whatever its size below
        the fusion threshold (a large one still leaves alone, in place).
        """
        if priority is not None and async_op and nbytes < self._threshold:
            route = FUSED  # agreed in rounds, so that priority can order what one round agrees
        else:
            route = self.route(tensor.device, nbytes, async_op)
        if route is FUSED:
            insp = self._insp
            if insp is not None and insp.debug is not None:
                with self._debug_lock:
                    insp.debug.check(self.seq, _DEFERRED_AR, tensor, None, reduce_op)
                    return self._fused(tensor, reduce_op, not async_op, priority)
            return self._fused(tensor, reduce_op, not async_op, priority)
        if route is SOLO:
            # Connected here on first use, outside the engine's lock: a rank that arrives first
            # waits for the others, whose engine threads must still run their rounds.
            tp = self._solo.get(tensor.device)
            return self._issue_solo(tensors, opts, tensor, reduce_op, tp)
        main = self._transport_for
        route = own_route(tensor, reduce_op, self._parts.world_size) if self._own_routes else 0
        if route and not async_op and (self._insp is None or self._insp.debug is None):
            if self._sync_own.run(tensors, tensor, reduce_op, route):
                return None  # complete: no Work (sync_own.py); else queued below
        parts = self._parts

        def launch(seq: int, chk: Check) -> Any:  # once the round agreed the call everywhere
            return own_routes.launch_allreduce(route, chk, tensors, opts, main(tensor.device),
                                               parts.rank, self._works, self._stats,
                                               None if async_op else parts.rounds.wait)

        return self._issue("all_reduce", lambda seq, chk: self._eager(
            seq, "all_reduce", lambda: launch(seq, chk), tensors, tensor.device, chk), tensor,
            opts, tensor.device, reduce_op, outputs=tensors,
            payload=tensor if route else None, route=route)  # INBAND, EXCHANGE: in the round

    def broadcast(self, tensors: list, opts: Any, tensor: torch.Tensor) -> Any:
        """A broadcast of `tensor` (`tensors` == [tensor], validated): carried in its check
        round where the round has room for it (checks.broadcast_route), else the transport's;
        its Work."""
        main = self._transport_for
        route = broadcast_route(tensor, self._parts.world_size) if self._own_routes else 0

        def launch(seq: int, chk: Check) -> Any:  # once the round agreed the call everywhere
            if chk.summed:  # the root's tensor came in the round (rounds.py)
                self._stats.record_carried_broadcast()
                return own_routes.done(self._works, chk.seq, tensors, "broadcast")
            return main(tensor.device).broadcast(tensors, opts)

        return self._issue("broadcast", lambda seq, chk: self._eager(
            seq, "broadcast", lambda: launch(seq, chk), tensors, tensor.device, chk), tensor,
            opts, tensor.device, outputs=tensors, payload=tensor if route else None,
            route=route)

    def collective(self, name: str, device: torch.device, call: Callable[[Any], Any],
                   outputs: Any, opts: Any = None, sig: torch.Tensor | None = None,
                   pair_bytes: Callable[[], tuple[list, list]] | None = None) -> Any:
        """Any other collective: `call(transport)` sends it, in sequence order; its Work.

        `sig`: the tensor the inspector records; `pair_bytes` (all-to-all): what this rank
        sends to and expects from each rank, checked pairwise under GRADIENTFLOW_DEBUG.
        """
        main = self._transport_for
        return self._issue(name, lambda seq, chk: self._eager(
            seq, name, lambda: call(main(device)), outputs, device, chk), sig, opts, device,
            pair_bytes=pair_bytes, outputs=outputs)

    def barrier(self, opts: Any) -> Any:
        """A barrier, in sequence order after everything issued before it.

        gloo's barrier waits for the collectives before it on its own group; the solo
        channel's are on another, so it gets a barrier too (issued first, in its own issue
        order, on the caller's thread), and the barrier's Work waits for both.
        """
        cpu = torch.device("cpu")
        main = self._transport_for
        solo = self._solo.existing("cpu") if self._solo is not None else None
        if solo is None:
            return self._issue("barrier", lambda seq, chk: self._eager(
                seq, "barrier", lambda: main(cpu).barrier(opts), [], cpu, chk), None, opts, cpu)

        def submit(seq: int, chk: Check | None) -> Any:
            # The solo part is queued at once, in the solo channel's issue order; a round that
            # refused the barrier afterwards would leave it there, so such a mismatch fails
            # the group instead (Claim.refusable).
            fut = completion.new_source(streams.future_devices(cpu))
            self._solo_ch.submit(SoloOp(None, lambda: solo.barrier(opts), [], fut))
            first = FutureWork(fut, self._works, seq, "barrier (solo channel)")
            second = self._eager(seq, "barrier", lambda: main(cpu).barrier(opts), [], cpu, chk,
                                 refusable=False)
            if isinstance(second, Claim):
                second.wrap = lambda work: AllWork([first, work])
                return second
            return AllWork([first, second])

        return self._issue("barrier", submit, None, opts, cpu)

    def stages(self, name: str, part: Any, device: torch.device, key: Hashable = None,
               dense_bytes: int = 0, fuser: Fuser = fuse,
               close: bool = True) -> torch.futures.Future:
        """A multi-stage op (a compressed bucket): queued for a fused batch of stage ops, agreed
        and run in sequence order on the engine thread; returns the future of its result.

        `part`: what `fuser` takes for this op (engine.stages; by default `part` is a StageGen
        and `fuse` drives it); `close`: no stage op of the same batch follows (a step's last
        bucket), so the batch is agreed now.
        """
        fut, public = completion.new_future(streams.future_devices(device))
        ready = streams.mark(device)
        with self._lock:
            seq = self._take(name)
            self._queue.push_stages(StagesOp(seq, name, part, fuser, device, fut, key,
                                             dense_bytes, ready, close))
            self._stats.record_stages()
            self._cv.notify_all()
        return public

    # ------------------------------------------------------------------ the routes
    def close(self, timeout_s: float) -> None:
        """Stop the solo channel's thread (what is queued there is failed by the engine)."""
        self._solo_ch.close(timeout_s)

    def _take(self, what: str) -> int:
        """The next sequence number (lock held), refused on a failed or destroyed group."""
        self._parts.check_usable(what)
        seq = self.seq
        self.seq = seq + 1
        return seq

    def _fused(self, tensor: torch.Tensor, reduce_op: Any, waited: bool,
               priority: int | None = None) -> FusedWork:
        """Queue an allreduce for fusion; its Work at once.

        `waited`: the caller waits on it right away (a synchronous call), so its batch is
        agreed at once instead of after the cycle time.
        """
        dev = tensor.device
        if dev.type == "cuda":
            fut = completion.new_source(streams.future_devices(dev))
            ready = streams.mark(dev)
        else:  # no future until somebody blocks or asks for one (completion.FusedCompletion)
            fut = ready = None
        insp = self._insp
        with self._lock:
            seq = self._take("allreduce")
            # hash() of a ReduceOp or RedOpType is its op number (cheaper than reading .op).
            op = FusableOp(seq, tensor, (dev, tensor.dtype, hash(reduce_op)), reduce_op, fut,
                           ready, priority)
            wake, crossed = self._queue.push_fused(op, waited)
            if wake:
                self._cv.notify_all()
            work = FusedWork(op, self._works)
            self._stats.record_deferred()
            if insp is not None:
                insp.record(seq, _DEFERRED_AR, tensor, None, reduce_op, work)
        if TIMELINE.enabled:
            op.queued_us = now_us()
        if crossed:
            # A full message is queued: let the engine have the GIL now to agree and send it.
            # A caller in a tight loop of submissions would otherwise keep the GIL for up to
            # Python's switch interval (5 ms), and the first message of a list would leave
            # only when the loop ends.
            time.sleep(0)
        if insp is not None:
            insp.attach(work, seq, _DEFERRED_AR)
        return work

    def _issue_solo(self, tensors: list, opts: Any, tensor: torch.Tensor, reduce_op: Any,
                    tp: Any) -> Any:
        """A solo allreduce: numbered, recorded and queued for the solo channel's thread,
        which checks it (with the solo calls queued beside it) and sends it (solo.py)."""
        key = signature("all_reduce", tensor, None, None, reduce_op)
        waited = not getattr(opts, "asyncOp", True)
        insp = self._insp
        if insp is not None and insp.debug is not None:
            with self._debug_lock:
                insp.debug.check(self.seq, "all_reduce", tensor, None, reduce_op)
        fut = completion.new_source(streams.future_devices(tensor.device))
        numel = tensor.numel()
        with self._lock:
            seq = self._take("all_reduce")
            work = FutureWork(fut, self._works, seq, "all_reduce")
            self._solo_ch.submit(SoloOp(Check(seq, key, None, waited),
                                        lambda: tp.allreduce(tensors, opts), tensors, fut,
                                        numel * tensor.element_size(), numel))
            if insp is not None:
                insp.record(seq, "all_reduce", tensor, None, reduce_op, work)
        if insp is not None:
            insp.attach(work, seq, "all_reduce")
        return work

    def _solo_sent(self, op: SoloOp, work: Any) -> None:
        """The solo channel's thread handed `op` to the transport."""
        with self._lock:
            # The caller is not quiet, and the transport is not idle (the queue's round
            # rule): a per-tensor loop that sends solos between its small tensors is still
            # issuing.
            self._queue.last_submit = time.monotonic()
            self._messages.solo_sent(work)
            if op.check is not None:
                self._stats.record_solo(op.nbytes, op.numel)

    def _refused(self, seqs: list) -> None:
        if self._insp is not None:
            with self._lock:
                self._insp.refuse(seqs)

    def _solo_round(self) -> Rounds:
        """The rounds of the solo channel (made at the first solo), on the side group the
        backend made for them (a round must not wait behind solo data on the wire). A group of
        one rank has none: its rounds wait for nobody, on the solo transport itself."""
        if self._solo_rounds is None:
            parts = self._parts
            group = parts.solo_agree_group or self._solo.existing("cpu")
            self._solo_rounds = Rounds(parts.rank, parts.world_size, group, self._stats,
                                       f"{parts.name} (solo channel)", payloads=False)
            self._solo_rounds.fault = parts.rounds.fault
        return self._solo_rounds

    def _settle(self, rounds: Rounds, chk: Check, refusable: bool) -> None:
        """Run `chk`'s round; a refused call is forgotten by the inspector and raised; any
        other failure of the round fails the group."""
        try:
            rounds.check(chk)
        except Exception as exc:  # noqa: BLE001 - a peer died, a fault: the group is broken
            if refuses_only_the_call(exc, refusable):
                self._refused([chk.seq])
                raise
            raise self._parts.fail(exc) from None

    def _run_claim(self, claim: Claim) -> Any:
        """Run a claimed eager call: its round, then its launch, on the caller's thread; the
        floor is released after (what queued behind it meanwhile then goes)."""
        seq = claim.check.seq
        try:
            self._settle(self._parts.rounds, claim.check, claim.refusable)
            work = claim.launch()
        finally:
            with self._lock:
                queue = self._queue
                queue.floor = False
                self.checking.discard(seq)
                if queue.issued or queue.agreed:  # what queued behind it goes now
                    self._cv.notify_all()
        claim.work = work
        return claim.wrap(work) if claim.wrap is not None else work

    def frontier(self) -> int:
        """The lowest sequence number the rounds have not settled yet (the inspector compares
        what is below it; see Inspector.find_mismatch)."""
        with self._lock:
            seqs = list(self.checking) + list(self._solo_ch.pending)
            issued = self._queue.issued
            if issued:
                seqs.append(issued[0].seq)
            seqs.extend(op.seq for op in self._queue.agreed
                        if isinstance(op, EagerOp) and op.check is not None)
            return min(seqs, default=self.seq)

    def _eager(self, seq: int, name: str, launch: Callable[[], Any], outputs: Any,
               device: torch.device | None = None, chk: Check | None = None,
               refusable: bool = True) -> Any:
        """Run a collective in sequence order (lock held); returns a Work, or a Claim.

        When nothing is queued or running, the call goes right here on the caller's thread
        (no hand-off): with a check, as a Claim that holds the queue's floor, whose round and
        launch run once the lock is released (_run_claim). This is what keeps synchronous
        collectives close to plain gloo. Otherwise it queues behind what was issued before it,
        and the engine thread runs its round just before sending it.
        `device`: where its tensors live (CUDA: ordered with this thread's stream).
        """
        queue = self._queue
        if not queue.issued and not queue.agreed and not queue.busy and not queue.floor:
            self._stats.record_eager(True)
            if chk is None:
                return launch()
            queue.floor = True
            self.checking.add(seq)
            return Claim(chk, launch, refusable=refusable)
        dev = device if device is not None else torch.device("cpu")
        fut = completion.new_source(streams.future_devices(dev))
        queue.issued.append(EagerOp(seq, name, launch, outputs, fut, dev, streams.mark(dev),
                                    chk, refusable))
        self._stats.record_eager(False)
        self._cv.notify_all()
        return FutureWork(fut, self._works, seq, name)

    def _issue(self, name: str, submit: Callable[[int, Check | None], Any], sig: Any,
               opts: Any, device: torch.device, reduce_op: Any = _UNSET,
               pair_bytes: Callable[[], tuple[list, list]] | None = None,
               outputs: Any = None, payload: torch.Tensor | None = None,
               route: int = 0) -> Any:
        """Number the call and `submit(seq, check)` it under the engine's lock, recording it for
        the inspector (checking it first under GRADIENTFLOW_DEBUG); run its round if it claimed
        the floor; a synchronous CPU call is waited on here, in slices, so a fault found
        meanwhile ends it with its own error."""
        fields = _OPT_FIELDS.get(type(opts))
        if fields is None:
            fields = _OPT_FIELDS[type(opts)] = tuple(
                hasattr(opts, f) for f in ("rootRank", "reduceOp", "asyncOp"))
        root = opts.rootRank if fields[0] else None
        if reduce_op is _UNSET:
            reduce_op = opts.reduceOp if fields[1] else None
        key = signature(name, sig, outputs, root, reduce_op)
        insp = self._insp
        waited = fields[2] and not opts.asyncOp
        if insp is not None and insp.debug is not None:
            with self._debug_lock:
                insp.debug.check(self.seq, name, sig, root, reduce_op, pair_bytes)
                seq, work = self._submit(name, submit, key, pair_bytes, waited, sig, root,
                                         reduce_op, payload, route)
        else:
            seq, work = self._submit(name, submit, key, pair_bytes, waited, sig, root,
                                     reduce_op, payload, route)
        if insp is None:
            return work
        if isinstance(work, FutureWork):
            insp.attach(work, seq, name)
        elif insp.sliced and fields[2] and not opts.asyncOp and device.type == "cpu":
            insp.wait_sync(work, seq, name)
        return work

    def _submit(self, name: str, submit: Callable[[int, Check | None], Any], key: tuple,
                pair_bytes: Any, waited: bool, sig: Any, root: Any,
                reduce_op: Any, payload: torch.Tensor | None = None,
                route: int = 0) -> tuple[int, Any]:
        """Take the call's number, submit it and record it (under the engine's lock); then
        run its round and launch if it claimed the floor. Returns (seq, its Work)."""
        insp = self._insp
        with self._lock:
            seq = self._take(name)
            work = submit(seq, Check(seq, key, pair_bytes, waited, payload, route))
            if insp is not None:
                insp.record(seq, name, sig, root, reduce_op, work)
        if isinstance(work, Claim):
            work = self._run_claim(work)
        return seq, work
