"""Every tensor a DistributedOptimizer stage hands to the transport lives on the inputs' device.

NCCL takes CUDA tensors only (gloo takes anything), so a stage that builds a small side tensor
on the CPU passes every CPU test and fails on a GPU: the compressed path's "had a gradient"
flags did (found on an H100 by the gpu-check of 2026-11-22). The meta device
stands in for CUDA here: no data, but every tensor keeps the device it was made on.
"""
from __future__ import annotations

import torch

from gradientflow.optim.gradient_reducer import GradientReducer, _PartitionOp
from gradientflow.optim.stages import dense_average


class _PassThrough:
    """A compressor with one stage that sends its input as it is (enough to see devices)."""

    def prepare(self, flat, layout, loss_scale=1.0, terms=None):
        return None

    def reduce_many(self, flats, layouts, loss_scale=1.0, prepared=None):
        out = yield torch.cat(flats)
        return list(out.split([f.numel() for f in flats]))


class _Reducer:
    """What GradientReducer._fuse reads of its reducer."""

    def _scales(self):
        return 1.0, 1.0

    def _deliver(self, segs, flat, used):
        pass


def _yielded_devices(gen) -> list[torch.device]:
    devices = []
    try:
        t = next(gen)
        while True:
            devices.append(t.device)
            t = gen.send(t)
    except StopIteration:
        pass
    except NotImplementedError:  # the final .tolist() of the flags: meta tensors hold no data
        pass
    return devices


def test_compressed_batch_yields_on_the_inputs_device():
    dev = torch.device("meta")
    layout = type("L", (), {"numels": (3, 5, 4)})()
    ops = [_PartitionOp(_PassThrough(), torch.empty(12, device=dev), layout, [None] * 3,
                        [True, False, True]) for _ in range(2)]
    devices = _yielded_devices(GradientReducer._fuse(_Reducer(), ops))
    assert len(devices) == 2 and all(d == dev for d in devices), devices


def test_dense_average_yields_on_the_inputs_device():
    dev = torch.device("meta")
    inputs = [torch.empty(3, device=dev), None]
    gen = dense_average(inputs, (3, 4), torch.float32, dev, 1.0, 1.0)
    devices = _yielded_devices(gen)
    assert len(devices) == 1 and devices[0] == dev, devices
