"""CSC at density 1 on an FP32 wire is DDP + the same optimizer, whatever the optimizer's settings.

With momentum correction the compressor applies SGD's momentum and weight decay; without it
(the default) the optimizer does, and the compressor follows its learning rates. At density 1
nothing is held back, so either must train as the dense run, step for step: with weight
decay on two parameter groups, Nesterov, maximize, any torch scheduler (including one that
writes the momentum every step) and a checkpoint loaded mid-run (the run's own, or a dense run's,
whose momentum buffers the compressor takes over).

Three levels: simulated ranks in one process (the hook state, 1-3 ranks, many examples); real
DDP through the hook and the DistributedOptimizer (on the gradientflow group and on gloo)
against DDP on gloo (2 and 3 ranks, started once per test, derandomized examples agreed by an
allgather); issue 35's table.

    python tests/compression/test_dense_equivalence.py   # prints the table of issue 35's rows
"""
from __future__ import annotations

import copy
import itertools
import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

TOL = 1e-5  # relative to the distance the dense run's weights travelled ...
# ... plus the float32 rounding of the weights themselves: the two runs sum the same terms in
# another order, so each step's update may round to a neighbouring float (a run that barely
# moves, at a learning rate of 4e-4, travels little more than those roundings).
ULPS_PER_STEP = 2
# Against a hang only: a pool's first task imports gradientflow and loads the kernels, which
# takes minutes on a loaded 2-core host.
TIMEOUT_S = 300
STEPS = 6
SCHEDULERS = (None, "step", "onecycle", "cyclic", "cosine", "momentum")

CASES = st.fixed_dictionaries({
    "seed": st.integers(0, 2**20),
    "momentum": st.sampled_from([0.0, 0.5, 0.9, 0.99]),
    "nesterov": st.booleans(),
    "maximize": st.booleans(),
    "lr": st.sampled_from([0.01, 0.1, 0.3]),
    "lr_vectors": st.sampled_from([1.0, 0.5]),  # the second group's lr, as a factor
    "wd": st.sampled_from([0.0, 1e-4, 5e-3, 0.1]),
    "wd_vectors": st.sampled_from([0.0, 1e-3]),
    "scheduler": st.sampled_from(SCHEDULERS),
    "checkpoint": st.sampled_from([None, "own", "dense"]),
    "checkpoint_at": st.integers(1, STEPS - 2),
    # The DistributedOptimizer's op: "sum" (its ranks' losses divided by the world size, to
    # train as the average does), or the average with a predivide factor of 1 or 4.
    "op": st.sampled_from(["average", "sum"]),
    "predivide": st.sampled_from([1.0, 4.0]),
    "mc": st.booleans(),  # momentum correction on (DGC's) or off (the default)
})


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))


def _optimizer(model, case):
    """torch.optim.SGD with two groups (matrices; vectors with their own lr and weight decay)."""
    mats = [p for p in model.parameters() if p.dim() > 1]
    vecs = [p for p in model.parameters() if p.dim() <= 1]
    m = case["momentum"]
    vectors = {"params": vecs, "lr": case["lr"] * case["lr_vectors"],
               "weight_decay": case["wd_vectors"]}
    return torch.optim.SGD(
        [{"params": mats}, vectors],
        lr=case["lr"], momentum=m, nesterov=case["nesterov"] and m > 0, weight_decay=case["wd"],
        maximize=case["maximize"])


class _MomentumSchedule:
    """A custom scheduler that writes every group's momentum each step (as OneCycleLR does)."""

    def __init__(self, opt):
        self.opt, self.t = opt, 0
        self.base = [g["momentum"] for g in opt.param_groups]

    def step(self):
        self.t += 1
        for g, m in zip(self.opt.param_groups, self.base):
            g["momentum"] = m * (0.4 + 0.3 * (self.t % 3))

    def state_dict(self):
        return {"t": self.t, "base": list(self.base)}

    def load_state_dict(self, sd):
        self.t, self.base = sd["t"], list(sd["base"])


def _scheduler(opt, case):
    kind, lr = case["scheduler"], case["lr"]
    sched = torch.optim.lr_scheduler
    if kind == "step":
        return sched.StepLR(opt, step_size=2, gamma=0.5)
    if kind == "onecycle":
        return sched.OneCycleLR(opt, max_lr=lr, total_steps=STEPS + 1, cycle_momentum=True)
    if kind == "cyclic":
        return sched.CyclicLR(opt, base_lr=lr / 10, max_lr=lr, step_size_up=2,
                              cycle_momentum=True, base_momentum=0.8, max_momentum=0.95)
    if kind == "cosine":
        return sched.CosineAnnealingLR(opt, T_max=STEPS)
    if kind == "momentum":
        return _MomentumSchedule(opt)
    return None


def _data(case, t, rank):
    g = torch.Generator().manual_seed(case["seed"] + 7919 * t + 31 * rank)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _distance(ours, dense, start, steps=STEPS) -> float:
    """How far `ours` is from `dense`, relative to how far `dense` travelled from `start`,
    less the weights' own float32 rounding over `steps` (see ULPS_PER_STEP; 0: the plain
    relative distance): equal within TOL if <= TOL."""
    travelled = float((dense - start).abs().max())
    rounding = ULPS_PER_STEP * steps * torch.finfo(torch.float32).eps * float(dense.abs().max())
    return max(0.0, float((ours - dense).abs().max()) - rounding) / max(travelled, 1e-12)


def _config(mc: bool = False):
    from gradientflow.compression import CompressionConfig

    return CompressionConfig(method="csc", density=1.0, wire_dtype="fp32", warmup_densities=(),
                             momentum_correction=mc)


class _Run:
    """One side of a comparison: a model, its optimizer and scheduler, built and rebuilt."""

    def __init__(self, case, base, wrap, loss_factor=1.0):
        self.case, self.base, self.wrap = case, base, wrap
        self.loss_factor = loss_factor
        self.build()

    def build(self):
        """Fresh objects from the base model (the weights are loaded after, by a resume)."""
        self.model, self.opt, self.extra = self.wrap(copy.deepcopy(self.base),
                                                     lambda m: _optimizer(m, self.case))
        self.sched = _scheduler(self.opt, self.case)

    def step(self, loss_of):
        self.opt.zero_grad()
        sign = -1.0 if self.case["maximize"] else 1.0  # maximize climbs: keep the loss bounded
        (sign * self.loss_factor * loss_of(self.model)).backward()
        self.opt.step()
        if self.sched is not None:
            self.sched.step()

    def save(self):
        return copy.deepcopy({"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                              "sched": None if self.sched is None else self.sched.state_dict(),
                              "extra": None if self.extra is None else self.extra.state_dict()})

    def resume(self, saved, opt_state=None):
        """Rebuild and load `saved`; `opt_state`: load this optimizer state instead (another
        run's), and no compression state."""
        self.close()
        self.build()
        self.model.load_state_dict(saved["model"])
        # A copy: torch's load_state_dict keeps the given tensors, which another run also loads.
        self.opt.load_state_dict(copy.deepcopy(saved["opt"] if opt_state is None else opt_state))
        if self.sched is not None:
            self.sched.load_state_dict(saved["sched"])
        if opt_state is None and self.extra is not None:
            self.extra.load_state_dict(saved["extra"])

    def close(self):
        if hasattr(self.opt, "close"):  # a DistributedOptimizer's gradient hooks
            self.opt.close()


def compare(case, dense_wrap, wraps, loss_for, loss_factors=None):
    """Train the dense run and each of `wraps` on the same data; return their distances.
    `loss_factors`: by name, what a run multiplies its loss by (default 1)."""
    base = _model(case["seed"])
    start = _flat(base)
    dense = _Run(case, base, dense_wrap)
    factors = loss_factors or {}
    runs = {name: _Run(case, base, wrap, factors.get(name, 1.0)) for name, wrap in wraps.items()}
    for t in range(STEPS):
        dense.step(loss_for(t))
        for run in runs.values():
            run.step(loss_for(t))
        if case["checkpoint"] is not None and t == case["checkpoint_at"]:
            dense_saved = dense.save()
            dense.resume(dense_saved)
            for run in runs.values():
                if case["checkpoint"] == "own":
                    run.resume(run.save())
                else:  # a dense run's checkpoint: its momentum buffers move into the compressor
                    run.resume(run.save(), opt_state=dense_saved["opt"])
    for run in runs.values():
        run.close()
    return {name: _distance(_flat(run.model), _flat(dense.model), start)
            for name, run in runs.items()}


# --- simulated ranks in one process: the hook state, many examples ---------------------------
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=CASES, world=st.integers(1, 3), loss_scale=st.sampled_from([1.0, 1024.0]))
def test_simulated_ranks_through_the_hook_state_equal_dense_sgd(case, world, loss_scale):
    """N ranks' hook states (CSCState bound to each rank's SGD), driven in lockstep on two
    buckets, against SGD on the average of the ranks' gradients. With a loss scale the buckets
    hold scaled gradients (the weight decay must enter scaled too) and are unscaled after, as
    GradScaler does before its step."""
    from compression_helpers import FakeBucket  # here: the rank processes lack this folder

    from gradientflow.engine.stages import drive_lockstep
    from gradientflow.hooks import CSCState

    base = _model(case["seed"])
    start = _flat(base)

    def local(model, make_opt):
        return model, make_opt(model), None

    def hooked(r):
        def wrap(model, make_opt):
            opt = make_opt(model)
            state = CSCState(None, _config(case["mc"]), optimizer=opt, world_size=world, rank=r)
            state.bind_parameter_names(model)
            state.set_loss_scale(loss_scale)
            return model, opt, state
        return wrap

    dense = _Run(case, base, local)
    ranks = [_Run(case, base, hooked(r)) for r in range(world)]
    for t in range(STEPS):
        grads = []
        for r, run in enumerate(ranks):
            x, y = _data(case, t, r)
            run.opt.zero_grad()
            ((run.model(x) - y) ** 2).mean().backward()
            if case["maximize"]:
                for p in run.model.parameters():
                    p.grad.neg_()
            grads.append([p.grad.clone() for p in run.model.parameters()])
            for p in run.model.parameters():
                p.grad.mul_(loss_scale)
        for i, p in enumerate(dense.model.parameters()):
            p.grad = sum(g[i] for g in grads) / world
        dense.opt.step()
        for r, run in enumerate(ranks):
            params = list(run.model.parameters())
            run.buckets = [FakeBucket(0, params[2:], False), FakeBucket(1, params[:2], True)]
        for b in range(2):
            outs = drive_lockstep([run.extra._stages(run.buckets[b]) for run in ranks])
            for run, out in zip(ranks, outs):
                run.buckets[b].write_back(out / loss_scale)
        for run in ranks + [dense]:
            if run is not dense:
                run.opt.step()
            if run.sched is not None:
                run.sched.step()
        if case["checkpoint"] is not None and t == case["checkpoint_at"]:
            dense_saved = dense.save()
            dense.resume(dense_saved)
            for run in ranks:
                saved = run.save()
                run.resume(saved, None if case["checkpoint"] == "own" else dense_saved["opt"])
    for r, run in enumerate(ranks):
        d = _distance(_flat(run.model), _flat(dense.model), start)
        assert d <= TOL, f"rank {r} of {world}: {case}: relative distance {d:.3g}"


# --- real DDP, through the hook and the DistributedOptimizer, against DDP on gloo -------------
def equal_to_ddp(rank, world, n_examples):
    """Rank body: random cases, each through the hook and the DistributedOptimizer, against
    DDP on a gloo group with the same optimizer; returns the worst distances."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradientflow.hooks
    import gradientflow.optim as gfo

    gloo = dist.new_group(backend="gloo")
    worst = {"hook": 0.0, "optimizer": 0.0, "optimizer on gloo": 0.0}

    def dense(model, make_opt):
        ddp = DDP(model, process_group=gloo)
        return ddp, make_opt(ddp), None

    def hook(case):
        def wrap(model, make_opt):
            ddp = DDP(model)  # on the default (gradientflow) group
            opt = make_opt(ddp)
            return ddp, opt, gradientflow.hooks.register(ddp, _config(case["mc"]), optimizer=opt)
        return wrap

    def optimizer(case, group):
        """The DistributedOptimizer wrap for `case`'s op, on `group` (None: gradientflow's)."""
        op = {"op": gfo.Sum} if case["op"] == "sum" else {
            "op": gfo.Average, "gradient_predivide_factor": case["predivide"]}

        def wrap(model, make_opt):
            opt = gfo.DistributedOptimizer(make_opt(model), compression=_config(case["mc"]),
                                           named_parameters=model.named_parameters(),
                                           partition_bytes=64, process_group=group, **op)
            return model, opt, None
        return wrap

    @settings(max_examples=n_examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=CASES)
    def prop(case):
        cases = [None] * world
        dist.all_gather_object(cases, case)
        assert all(c == cases[0] for c in cases), f"ranks run different examples: {cases}"

        def loss_for(t):
            x, y = _data(case, t, rank)
            return lambda model: ((model(x) - y) ** 2).mean()

        # The gloo group takes the synchronous path: everything reduced at step().
        wraps = {"hook": hook(case), "optimizer": optimizer(case, None),
                 "optimizer on gloo": optimizer(case, gloo)}
        summed = 1.0 / world if case["op"] == "sum" else 1.0  # a sum of mean/world is the mean
        found = compare(case, dense, wraps, loss_for, {"optimizer": summed,
                                                       "optimizer on gloo": summed})
        for name, d in found.items():
            assert d <= TOL, f"rank {rank}: {name}: {case}: relative distance {d:.3g}"
            worst[name] = max(worst[name], d)

    prop()
    return worst


@pytest.mark.parametrize("world,examples", [(2, 10), (3, 5)])
def test_hook_and_distributed_optimizer_equal_ddp(pools, world, examples):
    for rank, worst in enumerate(pools(world).run(equal_to_ddp, examples, timeout=TIMEOUT_S)):
        assert all(d <= TOL for d in worst.values()), (rank, worst)


# --- issue 35's table ---------------------------------------------------------------------------
ROWS = {
    "SGD(momentum=0.9)": {},
    "SGD(momentum=0.9, weight_decay=5e-4)": {"weight_decay": 5e-4},
    "the same + OneCycleLR(cycle_momentum=True)": {"weight_decay": 5e-4, "one_cycle": True},
}


def issue_rows(rank, world, steps=12):
    """Rank body: each row's distance of CSC (hook, density 1, FP32 wire) to dense DDP on gloo,
    2 ranks, 12 steps, as the issue measured it."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradientflow.hooks

    gloo = dist.new_group(backend="gloo")
    out = {}
    for (name, row), mc in itertools.product(ROWS.items(), (False, True)):
        torch.manual_seed(0)
        base = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(),
                                   torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        start = _flat(base)
        runs = []
        for compressed in (False, True):
            ddp = DDP(copy.deepcopy(base), process_group=None if compressed else gloo)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9,
                                  weight_decay=row.get("weight_decay", 0.0))
            if compressed:
                gradientflow.hooks.register(ddp, _config(mc), optimizer=opt)
            sched = None
            if row.get("one_cycle"):
                sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=steps,
                                                            cycle_momentum=True)
            for t in range(steps):
                g = torch.Generator().manual_seed(1000 * t + rank)
                x, y = torch.randn(8, 12, generator=g), torch.randn(8, 1, generator=g)
                opt.zero_grad()
                ((ddp(x) - y) ** 2).mean().backward()
                opt.step()
                if sched is not None:
                    sched.step()
            runs.append(_flat(ddp))
        # as the issue measured; with and without momentum correction
        out[f"{name}, momentum_correction={mc}"] = _distance(runs[1], runs[0], start, steps=0)
    return out


def test_issue_rows_equal_dense(pools):
    """The three rows of issue 35: every one equal to dense within TOL, on every rank."""
    for rank, rows in enumerate(pools(2).run(issue_rows, timeout=TIMEOUT_S)):
        for name, d in rows.items():
            assert d <= TOL, f"rank {rank}: {name}: relative distance {d:.3g} > {TOL}"


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from harness import RankPool

    pool = RankPool(2)
    try:
        rows = pool.run(issue_rows, timeout=TIMEOUT_S)[0]
    finally:
        pool.close()
    print("| optimizer setup | distance to dense, relative |\n|---|---|")
    for name, d in rows.items():
        print(f"| {name} | {d:.2g} |")
