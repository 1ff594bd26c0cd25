"""The planner: pure data, no torch. Costs in, a Plan (ordered ops, predicted memory and time) out."""
from .costs import ChainCosts, StageCost
from .ops import Backward, Forward, Free, Op, Update
from .plan import Plan
from .simulate import InvalidPlan, Simulation, simulate

__all__ = ["ChainCosts", "StageCost", "Backward", "Forward", "Free", "Op", "Update", "Plan",
           "InvalidPlan", "Simulation", "simulate"]
