#!/usr/bin/env python3
"""The picture of a step as ops on resources in docs/architecture.md: one plan's predicted
timeline (``plan/timeline.py``), a bar per op on the row of the resource that runs it.

    ./run python benchmarks/step_picture.py [--out docs/step-ops.png]

The plan is made here from round numbers, not measured: six like stages (1 s forward, 2 s
backward, 0.5 s update), the last four recomputed from checkpoints, every stage's weights
streamed from the disk one stage ahead (2 s a read) and the AdamW states on the disk too,
read while the update before runs and written back after their own (1 s each way).
Transfers are labelled by what they move: w2 is stage 2's weights, s5 stage 5's states.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tierflow.plan.costs import ChainCosts, StageCost  # noqa: E402
from tierflow.plan.plan import Plan  # noqa: E402
from tierflow.plan.kept_below import KeptBelow  # noqa: E402
from tierflow.plan.state_schedule import STATES  # noqa: E402
from tierflow.plan.strategies import checkpoint_all  # noqa: E402
from tierflow.plan.transfers import Transfers  # noqa: E402
from tierflow.plan.weight_schedule import StreamedWeights  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COLORS = {"compute": "#4c72b0", "disk read": "#55a868", "disk write": "#c44e52"}


def example_plan() -> Plan:
    """Six like stages, streamed and with their states on the disk (see the docstring)."""
    stage = StageCost("layer", fwd_time=1.0, bwd_time=2.0, param_bytes=200, output_bytes=10,
                      tape=30, update_time=0.5)
    costs = ChainCosts(stages=(stage,) * 6, input_bytes=10, static_bytes=0, optimizer_owned=True,
                       bandwidths={"disk read": 100.0, "disk write": 100.0})
    weights = StreamedWeights(tuple((i, 200, 200) for i in range(6)), "disk", "ram",
                              "disk read", "disk write", depth=1)
    states = KeptBelow(STATES, tuple((i, 100) for i in range(6)), "disk", "ram", "disk read",
                          "disk write", read_ahead=True)
    plan = Plan("checkpoint-all", tuple(checkpoint_all(costs)), costs)
    return plan.with_transfers(Transfers(weights, states))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "step-ops.png"))
    args = parser.parse_args()
    line = example_plan().timeline
    rows = [r for r in COLORS if any(s.resource == r for s in line.spans)]
    fig, ax = plt.subplots(figsize=(12, 2.6))
    for span in line.spans:
        y = len(rows) - 1 - rows.index(span.resource)
        ax.barh(y, span.end - span.start, left=span.start, height=0.6,
                color=COLORS[span.resource], edgecolor="white")
        label = span.name if span.resource == "compute" else \
            span.name.split("(")[1].split(" ")[0]  # "load(w2 disk>ram)": w2
        ax.text((span.start + span.end) / 2, y, label, ha="center", va="center", fontsize=6,
                color="white")
    ax.set_yticks(range(len(rows)), list(reversed(rows)))
    ax.set_xlabel(f"seconds (PREDICTED: one step of {line.time:.1f} s in the steady state)")
    ax.set_title("A step as ops on resources: compute, and the disk's read and write threads",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=130)
    print(args.out)


if __name__ == "__main__":
    main()
