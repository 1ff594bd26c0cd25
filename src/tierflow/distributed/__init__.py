"""Multi-worker training on ``torch.distributed``: data parallel with ZeRO-2 sharding, or
with replicas (``tierflow train --disk``: each rank's model and states on its own disk
tier, each stage's gradients averaged by ``World.average`` before its update).

- ``world.py``: joining the default process group from torchrun's environment (gloo for
  CPU tensors, NCCL for CUDA ones) and turning a lost rank into one error line;
- ``layout.py``: which rank owns which elements of each stage's parameters;
- ``reducer.py``: each stage's gradients reduce-scattered by the plan's Reduce op, right
  after its backward;
- ``zero.py``: the optimizer over this rank's shard, then parameters all-gathered by the
  plan's Gather ops;
- ``state.py``: the sharded optimizer state to and from the single-process checkpoint format.

The collectives of a step are plan ops (``plan/reductions.py``), priced there.
"""
from .world import RankLostError, World, exit_rank, join_from_env
from .zero import ShardedOptimizer

__all__ = ["RankLostError", "ShardedOptimizer", "World", "exit_rank", "join_from_env"]
