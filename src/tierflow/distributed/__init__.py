"""Multi-worker training on ``torch.distributed``: data parallel with ZeRO-2 sharding, or
with replicas (``tierflow train --disk``: each rank's model and states on its own disk
tier, each stage's gradients averaged by ``World.average`` before its update).

- ``world.py``: joining the default process group from torchrun's environment (gloo for
  CPU tensors, NCCL for CUDA ones) and turning a lost rank into one error line;
- ``layout.py``: which rank owns which elements of each stage's parameters;
- ``reducer.py``: each stage's gradients reduce-scattered as soon as its backward is done;
- ``zero.py``: the optimizer over this rank's shard, then parameters all-gathered;
- ``state.py``: the sharded optimizer state to and from the single-process checkpoint format;
- ``comm.py``: the step's predicted communication time (the bus bandwidth it divides by is
  measured by ``profile/machine.bus_bandwidth``).
"""
from .comm import step_seconds
from .world import RankLostError, World, exit_rank, join_from_env
from .zero import ShardedOptimizer

__all__ = ["RankLostError", "ShardedOptimizer", "World", "exit_rank", "join_from_env",
           "step_seconds"]
