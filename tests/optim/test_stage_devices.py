"""Every tensor a DistributedOptimizer stage hands to the transport lives on the inputs' device.

NCCL takes CUDA tensors only (gloo takes anything), so a stage that builds a small side tensor
on the CPU passes every CPU test and fails on a GPU: the compressed path's "had a gradient"
flags did (found on an H100 by the gpu-check of 2026-11-22). The meta device
stands in for CUDA here: no data, but every tensor keeps the device it was made on.
"""
from __future__ import annotations

import torch

from gradientflow.optim.stages import compressed_average, dense_average


class _PassThrough:
    """A compressor with one stage that sends its input as it is (enough to see devices)."""

    def reduce(self, flat, layout):
        out = yield flat
        return out


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


def test_compressed_average_yields_on_the_inputs_device():
    dev = torch.device("meta")
    inputs = [torch.empty(3, device=dev), None, torch.empty(2, 2, device=dev)]
    layout = type("L", (), {"numels": (3, 5, 4)})()
    devices = _yielded_devices(compressed_average(_PassThrough(), layout, inputs, 1.0, 1.0))
    assert len(devices) == 2 and all(d == dev for d in devices), devices


def test_dense_average_yields_on_the_inputs_device():
    dev = torch.device("meta")
    inputs = [torch.empty(3, device=dev), None]
    gen = dense_average(inputs, (3, 4), torch.float32, dev, 1.0, 1.0)
    devices = _yielded_devices(gen)
    assert len(devices) == 1 and devices[0] == dev, devices
