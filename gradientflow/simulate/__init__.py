"""Scale-out cost model: predict step time, speedup and epoch time on clusters we cannot run.

    >>> from gradientflow.simulate import Cluster, preset, simulate
    >>> r = simulate("resnet50", Cluster(gpus=512, gpus_per_node=8, inter_gbps=56),
    ...              preset("gradientflow"))
    >>> round(r.speedup) > 300
    True

See docs/SIMULATE.md for the model, its calibration on our emulated-switch runs, the
reproductions of the papers' numbers and what the model leaves out.
"""
from gradientflow.simulate.cluster import PRESETS, Cluster, Method, preset
from gradientflow.simulate.collectives import algorithm_bandwidth, allreduce_time, bytes_sent
from gradientflow.simulate.models import MODELS, Model, load
from gradientflow.simulate.step import Result, plan, simulate

__all__ = ["Cluster", "Method", "PRESETS", "preset", "MODELS", "Model", "load", "Result",
           "plan", "simulate", "allreduce_time", "algorithm_bandwidth", "bytes_sent"]
