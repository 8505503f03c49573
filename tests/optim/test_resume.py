"""DistributedOptimizer with CSC's recipe: resume equals an uninterrupted run; set_epoch.

5 steps, state_dict, a fresh model and optimizer loading it, 5 more steps: the parameters equal
those of 10 straight steps, on every rank (residuals, and the velocity under momentum correction,
travel in the state_dict; without it SGD's momentum buffers do, in the optimizer's own state).
"""
from __future__ import annotations

import pytest


def _mlp(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                               torch.nn.Tanh(), torch.nn.Linear(64, 2))


def resume(rank, world, epochs: bool, mc: bool):
    """Rank body: worst parameter difference of save/load at step 5 against 10 straight steps."""
    import io

    import torch

    import gradientflow.optim as gfo
    from gradientflow.compression import CompressionConfig

    schedule = {"warmup_unit": "epoch", "warmup_period": 1} if epochs else {"warmup_period": 2}
    cfg = CompressionConfig(density=0.05, chunk_size=16, momentum_correction=mc, **schedule)

    def build():
        model = _mlp(torch)
        opt = gfo.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4),
            named_parameters=model.named_parameters(), compression=cfg, partition_bytes=4096)
        return model, opt

    def train(model, opt, steps):
        for t in steps:
            if epochs:
                opt.set_epoch(t // 3)
            g = torch.Generator().manual_seed(100 * t + rank)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 2, generator=g)
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()

    straight, opt = build()
    # The groups keep the user's 0.9; under momentum correction the compressor follows it.
    assert opt.param_groups[0]["momentum"] == 0.9
    assert not mc or opt._compressor.config.momentum == 0.9
    train(straight, opt, range(10))
    opt.close()

    first, opt = build()
    train(first, opt, range(5))
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt.state_dict()}, buf)
    opt.close()
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    resumed, opt = build()
    resumed.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    assert opt._compressor.step == 5
    train(resumed, opt, range(5, 10))
    density = opt._compressor.density_in_force()
    opt.close()
    worst = max(float((a - b).abs().max())
                for a, b in zip(straight.parameters(), resumed.parameters()))
    # The control: the same resume without the compression state lands elsewhere.
    lost, opt = build()
    lost.load_state_dict(saved["model"])
    opt.load_state_dict({k: v for k, v in saved["opt"].items() if k != "gradientflow"})
    train(lost, opt, range(5, 10))
    opt.close()
    control = max(float((a - b).abs().max())
                  for a, b in zip(straight.parameters(), lost.parameters()))
    return worst, control, density


@pytest.mark.parametrize("epochs,mc", [(False, False), (True, False), (False, True)])
def test_resume_equals_an_uninterrupted_run(pools, epochs, mc):
    got = pools(2).run(resume, epochs, mc, timeout=120)
    for rank, (worst, control, density) in enumerate(got):
        assert worst == 0.0, (rank, worst)
        assert control > 1e-4, (rank, control)
        assert density == 0.05, (rank, density)


def test_state_dict_of_another_rank_is_refused():
    import torch

    import gradientflow.optim as gfo
    from gradientflow.compression import CompressionConfig

    model = _mlp(torch)
    opt = gfo.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression="csc")
    sd = opt.state_dict()
    assert "gradientflow" in sd and sd["gradientflow"]["rank"] == 0
    sd["gradientflow"]["rank"] = 1
    with pytest.raises(ValueError, match="rank 1's residuals"):
        opt.load_state_dict(sd)
    with pytest.raises(ValueError, match="Adam does not step as torch.optim.SGD.*"
                                         "momentum_correction=False"):
        gfo.DistributedOptimizer(torch.optim.Adam(model.parameters()),
                                 compression=CompressionConfig(momentum_correction=True),
                                 named_parameters=model.named_parameters())
