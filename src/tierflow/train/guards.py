"""What wraps a run's step loop: SIGINT as a request to stop after the current step (and
checkpoint), and ``--trace FILE`` recording."""
from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path


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
def traced(path: str | None, logger, rank: int = 0) -> Iterator[None]:
    """With ``--trace FILE``: record every step's spans and write them when the loop ends
    (however it ends: an interrupted or failed run's trace is the one to look at). Under
    torchrun rank 0 writes FILE and rank r the same name with ``.rank<r>`` before its
    suffix (``trace.rank1.json``)."""
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
            recorder.write(path)
            logger.print(f"trace: {path} ({len(recorder.events)} events; open it in "
                         "https://ui.perfetto.dev or chrome://tracing)")
