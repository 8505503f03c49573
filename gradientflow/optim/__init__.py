"""GradientFlow optim layer: Horovod's DistributedOptimizer with overlap and priority scheduling.

Three parts: GradientReducer (reducer.py) averages named parameters' gradients by partition and
knows nothing of torch.optim; DistributedOptimizer (optimizer.py) wraps an optimizer around it;
NextForwardOverlap (overlap.py) is the strategy that defers updates to the next forward.

    opt = gradientflow.optim.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    gradientflow.optim.broadcast_parameters(model.state_dict(), root_rank=0)
    gradientflow.optim.broadcast_optimizer_state(opt, root_rank=0)
"""
from gradientflow.optim.broadcast import broadcast_optimizer_state, broadcast_parameters
from gradientflow.optim.optimizer import (Average, DistributedOptimizer, OptimizerOptions,
                                          ReduceOp, Sum)
from gradientflow.optim.overlap import NextForwardOverlap
from gradientflow.optim.plan import Partition, build_plan
from gradientflow.optim.gradient_reducer import GradientReducer, ReducerOptions

__all__ = ["Average", "Sum", "ReduceOp", "DistributedOptimizer", "OptimizerOptions",
           "broadcast_parameters", "broadcast_optimizer_state", "Partition", "build_plan",
           "GradientReducer", "ReducerOptions", "NextForwardOverlap"]
