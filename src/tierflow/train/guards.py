"""What wraps a run's step loop: SIGINT as a request to stop after the current step (and
checkpoint), and ``--trace FILE`` recording."""
from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

from ..plan.plan import Plan
from ..plan.streaming import SHARED_DEVICE


class Interrupt:
    """SIGINT sets a flag the loop checks between steps; a second one interrupts at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> "Interrupt":
        with contextlib.suppress(ValueError):  # not the main thread
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


@contextlib.contextmanager
def traced(path: str | None, logger, plan_of: Callable[[], Plan], rank: int = 0
           ) -> Iterator[None]:
    """With ``--trace FILE``: record every step's spans and write them when the loop ends
    (however it ends: an interrupted or failed run's trace is the one to look at), beside
    the plan's predicted timeline (``plan_of()``: the plan running then) as a second
    process; the log gets each resource's busy seconds per micro-batch, predicted against
    measured, and the plan's predicted bytes of the compute tier beside the measured RSS
    (which counts what the process holds outside the plan too). Under torchrun rank 0
    writes FILE and rank r the same name with ``.rank<r>`` before its suffix
    (``trace.rank1.json``)."""
    if path is None:
        yield
        return
    from ..exec.trace import recording
    if rank:
        file = Path(path)
        path = str(file.with_name(f"{file.stem}.rank{rank}{file.suffix}"))
    with recording() as recorder:
        try:
            yield
        finally:
            plan = plan_of()
            predicted = plan.timeline
            recorder.write(path, predicted, plan_bytes(plan))
            logger.print(f"trace: {path} ({len(recorder.events)} events, the plan's predicted "
                         "timeline beside them; open it in https://ui.perfetto.dev or "
                         "chrome://tracing)")
            micro = max(1, len(recorder.micro_batches()))
            rows = sorted({s.resource for s in predicted.spans})
            busy = {row: (predicted.busy(row), recorder.working_seconds(row) / micro)
                    for row in rows}
            for device in sorted({SHARED_DEVICE[r] for r in rows if r in SHARED_DEVICE}):
                shared = [r for r in rows if SHARED_DEVICE.get(r) == device]
                busy[f"{device} ({', '.join(shared)})"] = (
                    sum(predicted.busy(r) for r in shared),  # they take turns in the plan
                    recorder.occupied_seconds(shared) / micro)
            logger.print("busy seconds per micro-batch, predicted / measured: " + ", ".join(
                f"{row} {p:.3g} / {m:.3g}" for row, (p, m) in busy.items()))
            logger.record("trace", path=path, micro_batches=micro,
                          predicted_step_s=predicted.time,
                          busy_s={row: {"predicted": p, "measured": m}
                                  for row, (p, m) in busy.items()})


def plan_bytes(plan: Plan) -> list[tuple[int, int]]:
    """Per op of ``plan``, the compute tier's bytes it predicts while the op runs and after
    it: the static bytes with the simulated activations, gradients and transients."""
    static = plan.costs.static_bytes
    return [(static + e.peak, static + e.resident) for e in plan.simulation.timeline]
