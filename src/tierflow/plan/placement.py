"""The tier placement planner: where weights, gradients and optimizer states live, and how.

Pure data (numpy, no torch); its input and output are ``plan/placement_problem.py``'s.
For each kind (weights, gradients, optimizer states with the fp32 master) the plan keeps
the first ``resident`` stages on the compute tier and the rest in a ``home`` tier below it:
weights are fetched ahead of each forward and backward (``prefetch`` stages ahead, into
``prefetch + 1`` reusable buffers), gradients leave after each micro-batch, and the
optimizer of a non-resident stage runs on the host (the CPU, in RAM) as soon as its last
gradient is in. Activations are kept, recomputed (rotor, given as ``ActivationOption``s
made by the caller) or offloaded to the tier below the compute tier. Under a partial
fine-tune only the trainable parameters have gradients and optimizer states; frozen weights
are fetched and never written back, and the forward-only stages at the front once.

Time model, per step of ``grad_accum`` micro-batches: stages are grouped in windows of
``prefetch`` consecutive stages, and each window costs max(compute, each link's transfers);
the first window's fetch is exposed; the host optimizer overlaps the last micro-batch's
backward when compute runs on a GPU (but for the last stage's share) and adds to the step
on a CPU. Among the placements whose peak fits every tier's budget the fastest wins (within
0.5%, the one that keeps most on the compute tier); when none fits, ``PlacementError``
names the smallest budget of each tier.
"""
from __future__ import annotations

import itertools

import numpy as np

from ..units import format_bytes
from .placement_problem import (
    ActivationOption,
    KindPlacement,
    Placement,
    Problem,
    infeasible_error,
)

PREFETCH_DEPTHS = (1, 2, 4)
TIE = 0.005  # placements this close to the fastest count as equally fast


class _Grid:
    """Every candidate (resident counts on a grid of at most 17 values per kind, homes,
    activation option, prefetch depth) as numpy columns: per-tier peaks, per-resource times
    and the step time."""

    def __init__(self, problem: Problem):
        self.p = problem
        n = len(problem.params)
        step = max(1, -(-n // 16))
        self.counts = sorted(set(range(0, n + 1, step)) | {n})
        self.params = np.asarray(problem.params, dtype=np.float64)
        self.trainable = np.asarray(problem.trainable or problem.params, dtype=np.float64)
        # fetches of a stage's weights per micro-batch: for its forward and its backward
        self.fetches = np.where(np.arange(n) < problem.forward_only, 1.0, 2.0)

    def blocks(self) -> list[dict]:
        p = self.p
        homes = list(range(1, len(p.tiers))) or [0]
        out = []
        for w_home, o_home, act, depth in itertools.product(homes, homes, p.activations,
                                                            PREFETCH_DEPTHS):
            if (act.mode.startswith("offload") and len(p.tiers) < 2) or (
                    act.with_grads and p.grad_accum > 1):
                continue
            out.append(self._block(w_home, o_home, act, depth))
        return out

    def _block(self, w_home: int, o_home: int, act: ActivationOption, depth: int) -> dict:
        p, prec, acc, host = self.p, self.p.precision, self.p.grad_accum, self.p.host
        params, trainable, n = self.params, self.trainable, len(self.p.params)
        kw, kg, ko = (np.asarray(v) for v in zip(*[
            c for c in itertools.product(self.counts, repeat=3)
            if c[2] <= min(c[0], c[1]) and (not act.with_grads or c[1] == n)
            and (len(p.tiers) > 1 or c == (n, n, n))]))
        idx = np.arange(n)
        sw, sg, so = (idx[None, :] >= k[:, None] for k in (kw, kg, ko))  # (cands, stages)
        g_home = max(host, 1) if len(p.tiers) > 1 else 0
        links = len(p.links)
        up = np.zeros((links, *sw.shape))  # pipelined with compute, bytes per stage and step
        down = np.zeros_like(up)
        opt_up = np.zeros((links, len(kw)))  # around the host optimizer, bytes per step
        opt_down = np.zeros_like(opt_up)

        def move(arr: np.ndarray, start: int, stop: int, amount: np.ndarray) -> None:
            for link in range(start, stop):
                arr[link] += amount

        def total(mask: np.ndarray, width: float) -> np.ndarray:
            """Bytes of the trainable parameters of the stages ``mask`` selects."""
            return _bytes(trainable, mask, width).sum(axis=1)

        move(up, 0, w_home, self.fetches * prec.weights * params * sw * acc)
        move(down, 0, g_home, prec.grads * trainable * sg * acc)  # after each micro-batch
        if act.mode.startswith("offload"):
            move(up, 0, 1, np.full(sw.shape, act.offload_bytes / n * acc))
            move(down, 0, 1, np.full(sw.shape, act.offload_bytes / n * acc))
        move(opt_down, 0, host, total(so & ~sg, prec.grads))  # accumulated on compute
        move(opt_up, host, g_home, total(so & sg, prec.grads))
        move(opt_up, host, o_home, total(so, prec.states))
        move(opt_down, host, o_home, total(so, prec.states))
        move(opt_down, host, w_home, total(so & sw, prec.weights))  # updated weights home
        move(opt_up, 0, host, total(so & ~sw, prec.weights))  # ... or to the compute tier

        gpu = p.tiers[0].name == "gpu"
        compute = np.asarray(p.compute) * (act.time / max(sum(p.compute), 1e-12)) * acc
        host_time = total(so, prec.update_traffic) / p.host_update_bw
        device_time = total(~so, prec.update_traffic) / p.device_update_bw
        pad = -n % depth
        windows = np.pad(compute, (0, pad)).reshape(-1, depth).sum(axis=1)
        busiest = np.zeros((len(kw), len(windows)))
        exposed = np.zeros(len(kw))
        host_phase = host_time
        # on a CPU the host optimizer is the compute device's own work
        times = {"compute": compute.sum() + device_time + (0 if gpu else host_time)}
        if gpu:
            times["host optimizer"] = host_time
        for link in range(links):
            a, b = p.tiers[link].name, p.tiers[link + 1].name
            for arr, opt, bw, name in ((up, opt_up, p.links[link].up, f"{b}->{a}"),
                                       (down, opt_down, p.links[link].down, f"{a}->{b}")):
                seconds = arr[link] / bw  # (cands, stages)
                grouped = np.pad(seconds, ((0, 0), (0, pad))).reshape(len(kw), -1, depth)
                busiest = np.maximum(busiest, grouped.sum(axis=2))
                exposed = np.maximum(exposed, seconds[:, 0] / acc)
                host_phase = np.maximum(host_phase, opt[link] / bw)
                times[name] = seconds.sum(axis=1) + opt[link] / bw
        pipeline = np.maximum(windows[None, :], busiest).sum(axis=1)
        # on a GPU the host optimizer overlaps the last micro-batch's backward (2/3 of it),
        # all but the update of the stage whose backward comes last, which is exposed
        overlap = (2 / 3) * compute.sum() / acc
        tail = np.maximum(0.0, host_phase - overlap) + host_phase / n if gpu else host_phase
        return {"kw": kw, "kg": kg, "ko": ko, "w_home": w_home, "o_home": o_home,
                "g_home": g_home, "act": act, "depth": depth,
                "step": pipeline + exposed + device_time + tail,
                "peaks": self._peaks(kw, sw, sg, so, w_home, o_home, g_home, act, depth),
                "times": {k: np.broadcast_to(v, kw.shape) for k, v in times.items()}}

    def _peaks(self, kw, sw, sg, so, w_home, o_home, g_home, act, depth) -> dict:
        p, prec = self.p, self.p.precision
        tiers = [t.name for t in p.tiers]
        peak = {t: np.zeros(len(kw)) for t in tiers}

        def total(mask: np.ndarray, width: float, of: np.ndarray = self.trainable) -> np.ndarray:
            """Bytes of ``of`` (trainable parameters, or every weight) the mask selects."""
            return _bytes(of, mask, width).sum(axis=1)

        def biggest(mask: np.ndarray, width: float, of: np.ndarray = self.trainable
                    ) -> np.ndarray:
            return _bytes(of, mask, width).max(axis=1)

        c, weights = tiers[0], self.params
        peak[c] += total(~sw, prec.weights, weights) + total(~so, prec.states) + act.peak
        peak[c] += p.runtime_bytes + (0 if act.with_grads else total(~sg, prec.grads))
        peak[c] += (depth + 1) * biggest(sw, prec.weights, weights) + biggest(sg, prec.grads)
        if len(tiers) > 1:
            peak[tiers[w_home]] += total(sw, prec.weights, weights)
            peak[tiers[g_home]] += total(sg, prec.grads)
            peak[tiers[o_home]] += total(so, prec.states)
            peak[tiers[1]] += act.offload_bytes if act.mode.startswith("offload") else 0
            host = tiers[p.host]
            if w_home > p.host:
                peak[host] += depth * biggest(sw, prec.weights, weights)
            if o_home > p.host:
                peak[host] += 2 * biggest(so, prec.states + prec.grads)
        return {t: np.ceil(v) for t, v in peak.items()}


def _bytes(params: np.ndarray, mask: np.ndarray, width: float) -> np.ndarray:
    """(candidates, stages) bytes of the stages ``mask`` selects, at ``width`` per parameter."""
    return width * params * mask


def place(problem: Problem) -> Placement:
    """The fastest placement whose peaks fit every budget; PlacementError when none does."""
    blocks = _Grid(problem).blocks()
    budgets = {t.name: t.budget for t in problem.tiers}

    def fits(block: dict, lifted: str | None = None) -> np.ndarray:
        ok = np.ones(len(block["kw"]), dtype=bool)
        for tier, budget in budgets.items():
            if budget is not None and tier != lifted:
                ok &= block["peaks"][tier] <= budget
        return ok

    feasible = [(b, np.flatnonzero(fits(b))) for b in blocks]
    fastest = min((float(b["step"][ok].min()) for b, ok in feasible if ok.size), default=None)
    best: tuple | None = None
    if fastest is not None:  # within 0.5% of the fastest, the most resident wins: fewer moves
        for b, ok in feasible:
            for c in ok[b["step"][ok] <= fastest * (1 + TIE)]:
                key = (-int(b["kw"][c]), -int(b["ko"][c]), -int(b["kg"][c]),
                       b["act"].mode != "keep", b["depth"], float(b["step"][c]))
                if best is None or key < best[0]:
                    best = (key, b, int(c))
    smallest: dict[str, int | None] = {}
    floors: dict[str, int] = {}  # the least peak of each tier whatever the other budgets
    for tier in budgets:  # the least peak of each tier among placements that fit the others
        ok = [b["peaks"][tier][fits(b, lifted=tier)] for b in blocks]
        ok = [float(v.min()) for v in ok if v.size]
        smallest[tier] = int(min(ok)) if ok else None
        floors[tier] = int(min(float(b["peaks"][tier].min()) for b in blocks))
    if best is None:
        raise infeasible_error(budgets, smallest, floors)
    return _placement(problem, best[1], best[2], budgets, smallest)


def _placement(problem: Problem, block: dict, c: int, budgets: dict[str, int | None],
               smallest: dict[str, int | None]) -> Placement:
    tiers = [t.name for t in problem.tiers]
    n = len(problem.params)
    row = {k: (v[c] if isinstance(v, np.ndarray) else v) for k, v in block.items()
           if k not in ("peaks", "times")}
    times = {k: float(v[c]) for k, v in block["times"].items()}
    row["step"] = float(row["step"])
    name, seconds = max(times.items(), key=lambda kv: kv[1])
    act: ActivationOption = row["act"]
    share = seconds / row["step"] if row["step"] > 0 else 0.0
    what = {"compute": "compute-bound: the matmuls and element-wise kernels",
            "host optimizer": "the host (CPU) optimizer updating the states kept in RAM"}
    bottleneck = what.get(name, f"the {name} link, moving weights, gradients, optimizer states "
                                f"or activations")
    notes = []
    if act.mode == "recompute":
        notes.append(f"rotor recomputes {act.recomputed} stage forwards to fit activations in "
                     f"{format_bytes(act.peak)}")
    if act.mode == "offload":
        notes.append(f"every stage's saved activations ({format_bytes(act.offload_bytes)} per "
                     f"micro-batch) go to {tiers[1]} after its forward and come back before "
                     f"its backward")
    if act.mode == "offload+recompute":
        notes.append(f"every stage boundary ({format_bytes(act.offload_bytes)} per micro-batch) "
                     f"goes to {tiers[1]} and back; each stage is recomputed before its backward")
    return Placement(
        compute_tier=tiers[0], stages=n,
        weights=KindPlacement(int(row["kw"]), tiers[row["w_home"]]),
        grads=KindPlacement(int(row["kg"]), tiers[row["g_home"]]),
        optimizer=KindPlacement(int(row["ko"]), tiers[row["o_home"]]),
        activations=act.mode, recomputed=act.recomputed, prefetch=row["depth"],
        peaks={t: int(v[c]) for t, v in block["peaks"].items()}, budgets=budgets,
        times=times, step_time=row["step"],
        bottleneck=f"{bottleneck} ({seconds:.3g} s, {share:.0%} of the step)",
        smallest=smallest,
        notes=tuple(notes))
