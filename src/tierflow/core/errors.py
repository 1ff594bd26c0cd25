"""Errors a user can fix. Each message is one line: the value, the limit and the fix."""
from __future__ import annotations

from .units import with_rerun_margin


class TierflowError(ValueError):
    """Bad input or an impossible request; the CLI prints it as one line and exits with 2."""


class BudgetError(TierflowError):
    """No plan fits the budget. ``smallest`` is the smallest budget (bytes) that works with
    what this run measured; ``to_give`` leaves room for what the next run measures."""

    def __init__(self, message: str, *, tier: str, budget: int, smallest: int):
        super().__init__(message)
        self.tier = tier
        self.budget = budget
        self.smallest = smallest

    @property
    def to_give(self) -> int:
        """A budget (bytes) that works in a new process: ``smallest`` plus the margin for
        sizes measured before planning (the runtime's bytes), which vary by a few MiB."""
        return with_rerun_margin(self.smallest)
