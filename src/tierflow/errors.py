"""Errors a user can fix. Each message is one line: the value, the limit and the fix."""
from __future__ import annotations


class TierflowError(ValueError):
    """Bad input or an impossible request; the CLI prints it as one line and exits with 2."""


class BudgetError(TierflowError):
    """No plan fits the budget. ``smallest`` is the smallest budget (bytes) that works."""

    def __init__(self, message: str, *, tier: str, budget: int, smallest: int):
        super().__init__(message)
        self.tier = tier
        self.budget = budget
        self.smallest = smallest
