"""The memory side of rotor (plan/rotor.py): the chain's byte terms in whole units, and what
each step of a segment's schedule needs, against the segment's own budget. Pure data.

Memory of a segment. The bytes a segment "owns" are x[a], grad[b+1] and everything created
while it runs; its context (outer checkpoints and tapes, the parameter gradients of stages
> b, ...) stays constant while it runs. ``m`` below is the budget left for the owned bytes,
and a schedule is feasible for ``m`` when every op's peak (as ``simulate()`` counts it:
resident bytes plus the op's new outputs plus its transient) minus the context is <= m.
With X = x bytes, T = tape, g = gradient of an x, P = parameter gradients, tr = transients,
lin(j, b) = what [j, b] leaves behind besides g[j] (P of j..b unless updated at once, plus
the shared gradients when b = L-1), the needs are:

  tape option, own ops:  Forward(a):  X[a] + g[b+1] + X[a+1] + T[a] + tr_fwd[a]
                         Backward(a): X[a] + T[a] + g[a+1] + X[a+1]*out_in_tape[a]
                                      + lin(a+1, b)*(a < b) + g[a] + P[a]
                                      + shared*(a == L-1) + tr_bwd[a]
                         Update(a):   g[a] + P[a] + shared*(b == L-1) + tr_upd[a]
                                      (+ X[a] when x[a] outlives the segment, see below)
                child [a+1, b] gets m - X[a] - T[a]
  checkpoint option:     Forward(k): X[a] + g[b+1] + X[k]*(k > a) + X[k+1] + tr_nograd[k]
                child [j, b] gets m - X[a]; child [a, j-1] gets m - lin(j, b)

x[a] outlives its segment when a == 0 (the caller's input) or when the tape of stage a-1
keeps it (output_in_tape), which only matters to Update(a); every schedule of [a, b] ends
with the same Update(a) need, so "x[a] outlives" is one extra threshold on the whole
segment (``SegmentNeeds.keep_need``), not a second table.

Stashed boundaries. When the costs call x[a] stashable (``ChainCosts.stashable``) and only
the plan holds it, the checkpoint option may keep it on the tier below while it is not
needed: Forward(a) ; Stash(a) ; the other forwards ; solve [j, b] ; Fetch(a) ; solve
[a, j-1]. Then x[a] costs nothing after Forward(a) (the sweep's later forwards and child
[j, b] get m instead of m - X[a]). Whether only the plan holds x[a] depends on the parent,
so the tables have two kinds of segment: HELD (x[a] is the caller's x[0], or tape[a-1]
holds it: the child of a tape option) and PLAN (x[a] was made by a forward without tape:
the later child [j, b] of a checkpoint option). The early child [a, j-1] is of its
parent's kind. Without stashable boundaries the two tables are the same.
"""
from __future__ import annotations

from typing import Union

import numpy as np

from .costs import ChainCosts

HELD, PLAN = 0, 1  # segment kinds: x[a] held by more than the plan, or by the plan alone
Index = Union[int, np.ndarray]  # one stage index, or an array of them (vectorised splits)


NEEDS_FIELDS = ("fwd_time", "bwd_time", "update_time", "param_bytes", "output_bytes", "tape",
                "fwd_transient", "fwd_transient_nograd", "bwd_transient", "update_transient",
                "input_grad", "needs_backward")  # what the tables and simulate() read of a stage


def needs_key(costs: ChainCosts) -> tuple:
    """Everything of ``costs`` that ``SegmentNeeds`` and ``simulate()`` read, context and
    static bytes aside: chains with equal keys get the same rotor tables. A tier search
    plans many candidates whose costs differ only elsewhere (static bytes, host update
    times, notes), so rotor remembers its results under this key."""
    return (tuple(tuple(getattr(s, f) for f in NEEDS_FIELDS) for s in costs.stages),
            costs.input_bytes, costs.optimizer_owned, costs.grads_resident,
            costs.shared_grad_bytes, costs.stashable)


class SegmentNeeds:
    """The chain's byte terms rounded up to whole ``unit``s, and the memory needs of the
    steps of a rotor schedule, measured against the segment's own budget (module docstring).

    Rounding every term up means a plan that fits in units fits in bytes too: each op's
    true peak is a sum of terms, each at most ``unit`` times its rounded value.
    """

    def __init__(self, costs: ChainCosts, unit: int):
        def up(n: int) -> int:
            return -(-n // unit)

        stages = costs.stages
        self.length = costs.length
        self.owned = costs.optimizer_owned
        self.x = [up(costs.x_bytes(i)) for i in range(self.length + 1)]
        self.tape = [up(s.tape) for s in stages]
        # the executor keeps each taped stage's output tensor until its backward (the
        # simulator's rule), so for memory every output counts as held by its tape
        self.out_in_tape = [True for _ in stages]
        self.tr_fwd = [up(s.fwd_transient) for s in stages]
        self.tr_nograd = [up(s.fwd_transient_nograd) for s in stages]
        self.tr_bwd = [up(s.bwd_transient) for s in stages]
        self.tr_upd = [up(s.update_transient) for s in stages]
        # bytes of the parameter gradients each backward makes (none when they are resident
        # all step: accumulated into, and counted in the static bytes)
        self.params = [0 if costs.grads_resident else up(s.param_bytes) for s in stages]
        self.shared = 0 if costs.grads_resident else up(costs.shared_grad_bytes)
        # g[i]: gradient of x[i], made by Backward(i); the loss x[L] gets none.
        self.grad = [self.x[i] if s.input_grad else 0 for i, s in enumerate(stages)] + [0]
        self._fwd_prefix = np.concatenate([[0.0], np.cumsum([s.fwd_time for s in stages])])
        self.finish_time = [s.bwd_time + (s.update_time if self.owned else 0.0)
                            for s in stages]
        self._param_prefix = np.concatenate([[0], np.cumsum(self.params, dtype=np.int64)])
        self.stashable = [i in costs.stashable for i in range(self.length + 1)]
        self.kinds = 2 if any(self.stashable) else 1  # one table serves both kinds without
        self._sweep_peaks = self._sweep_peak_table()

    def stashes(self, a: int, kind: int) -> bool:
        """Whether the checkpoint option of a segment of this kind stashes x[a]."""
        return kind == PLAN and self.stashable[a]

    def checkpoint_hold(self, a: int, kind: int) -> int:
        """What x[a] costs the checkpoint option after Forward(a): nothing when stashed."""
        return 0 if self.stashes(a, kind) else self.x[a]

    def fwd_time(self, a: int, j: Index) -> Index:
        """Seconds of the forwards of stages a..j-1 (per element for an array of j)."""
        return self._fwd_prefix[j] - self._fwd_prefix[a]

    def lingering(self, j: Index, b: Index) -> Index:
        """What solving [j, b] leaves resident besides g[j]: the parameter gradients of
        stages j..b (none when each is updated and freed right away) and, once the last
        stage's backward has run, the shared gradients (they live until Update(0))."""
        params = 0 if self.owned else self._param_prefix[b + 1] - self._param_prefix[j]
        if np.ndim(b):  # one b per element
            return params + np.where(b == self.length - 1, self.shared, 0)
        return params + (self.shared if b == self.length - 1 else 0)

    def update_need(self, a: int, b: int) -> int:
        """Peak of Update(a) at the end of [a, b], when x[a] does not outlive it."""
        if not self.owned:
            return 0
        last = self.shared if b == self.length - 1 else 0
        return self.grad[a] + self.params[a] + last + self.tr_upd[a]

    def keep_need(self, a: int, b: int) -> int:
        """The budget [a, b] needs at least when x[a] outlives it (it is then resident
        during Update(a)); 0 without an optimizer step."""
        return self.x[a] + self.update_need(a, b) if self.owned else 0

    def keeps_input(self, a: int) -> bool:
        """Whether x[a] outlives a segment that starts at a as the child of a tape option
        (stage a-1's tape holds it) or at the top (x[0] belongs to the caller)."""
        return a == 0 or self.out_in_tape[a - 1]

    def frees_output(self, a: int, b: int) -> bool:
        """Whether the tape option drops x[a+1] right after Forward(a): in a one-stage
        segment nothing forwards from it again, and unless stage a's tape keeps it the
        backward does not need it (only grad[a+1])."""
        return a == b and not self.out_in_tape[a]

    def tape_need(self, a: int, b: int) -> int:
        """Peak of the tape option's own ops (Forward(a), Backward(a), Update(a)).

        At Backward(a), x[a+1] is resident only through the tape (output_in_tape): for
        a < b the child's Backward(a+1) dropped the plan's reference, for a == b the
        Free right after Forward(a) did. The shared gradients appear at Backward(L-1).
        """
        x, g = self.x, self.grad
        forward = x[a] + g[b + 1] + x[a + 1] + self.tape[a] + self.tr_fwd[a]
        made_before = self.lingering(a + 1, b) if a < b else 0
        shared_now = self.shared if a == self.length - 1 else 0
        backward = (x[a] + self.tape[a] + g[a + 1] + x[a + 1] * self.out_in_tape[a]
                    + made_before + g[a] + self.params[a] + shared_now + self.tr_bwd[a])
        return max(forward, backward, self.update_need(a, b))

    def sweep_needs(self, a: int, b: int, kind: int) -> np.ndarray:
        """needs[j - a - 1]: peak of the no-tape forwards a..j-1 of the checkpoint option
        with split j, for j = a+1..b (a running maximum over the forwards). Every forward
        of the sweep holds g[b+1], so the running maximum without it is kept per (a, kind)
        and g[b+1] added here."""
        return self._sweep_peaks[kind][a][: b - a] + self.grad[b + 1]

    def _sweep_peak_table(self) -> list[list[np.ndarray]]:
        """[kind][a]: the running maximum, over k = a..L-2, of what Forward(k) without tape
        holds at its peak in the sweep starting at a, g[b+1] left out."""
        x = np.array(self.x, dtype=np.int64)
        made = x[1:] + np.array(self.tr_nograd, dtype=np.int64)  # x[k+1] + transient[k]
        table = []
        for kind in range(self.kinds):
            rows = []
            for a in range(self.length - 1):
                held = x[a:self.length - 1] + self.checkpoint_hold(a, kind)  # x[k] + x[a]
                held[0] = x[a]  # Forward(a) holds x[a] itself, not yet stashed
                rows.append(np.maximum.accumulate(held + made[a:self.length - 1]))
            rows.append(np.zeros(0, dtype=np.int64))  # the last stage has no split
            table.append(rows)
        return table

    def tape_hold(self, a: int) -> int:
        """What the tape option holds while its child [a+1, b] runs: x[a] and tape[a]."""
        return self.x[a] + self.tape[a]
