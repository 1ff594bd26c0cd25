"""Where each of a plan's transfer ops goes: a weights transfer to the streamer of the
stages' weights, a states transfer to the optimizer that owns them, a tape transfer to the
tapes' offload, a checkpoint's to the stash, a gradients transfer to the gradients'
stash when it holds the stage's (streamed) gradients, else to the optimizer that steps the
stage in host RAM (their Store down to it), a collective between the ranks to ``collective``."""
from __future__ import annotations

from collections.abc import Callable

from ..plan.boundary_schedule import BOUNDARY
from ..plan.ops import COLLECTIVES, WEIGHTS, Collective, Transfer
from ..plan.state_schedule import STATES
from ..plan.tape_schedule import TAPE
from ..plan.gradient_schedule import GRADS
from .boundaries import BoundaryStash
from .gradients import GradientStash
from .optimizer import OwnedOptimizer
from .tapes import TapeOffload
from .weights import WeightStreamer


def transfer_to(weights: WeightStreamer | None, states: OwnedOptimizer | None,
                tapes: TapeOffload | None = None,
                boundaries: BoundaryStash | None = None,
                gradients: GradientStash | None = None,
                collective: Callable[[Collective], None] | None = None
                ) -> Callable[[Transfer], None]:
    """The function that starts a transfer op on what moves its tensors."""
    def start(op: Transfer) -> None:
        if isinstance(op, COLLECTIVES):
            collective(op)
        elif op.what == WEIGHTS:
            weights.dispatch(op)
        elif op.what == STATES:
            states.dispatch(op)
        elif op.what == TAPE:
            tapes.dispatch(op)
        elif op.what == BOUNDARY:
            boundaries.dispatch(op)
        elif op.what == GRADS and gradients is not None and op.stage in gradients.stage_params:
            gradients.dispatch(op)
        elif op.what == GRADS:  # a host-stepped stage's, down to host RAM for its step
            states.dispatch(op)
        else:
            raise ValueError(f"{op}: nothing moves {op.what!r}")
    return start
