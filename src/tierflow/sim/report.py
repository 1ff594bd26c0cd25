"""What ``tierflow plan`` prints: the predicted placement, peaks, time and bottleneck, in the
trainer's ``[Section]`` style, every figure labelled PREDICTED."""
from __future__ import annotations

from ..core.units import format_bytes, format_rate, section
from .hardware import Hardware
from .predict import Prediction


MEASURED = ("every stage measured here as tierflow train measures it before it plans (a copy "
            "with one decoder layer and random weights; every layer priced at that one), the "
            "optimizer probed as the trainer probes it")
TRAINER = ("every stage, the optimizer and the disk tier as a run of tierflow train measured "
           "them here before it planned, and its budget: the plan that run made")
EFFICIENCY = {"measured": MEASURED, "trainer": TRAINER}
RAN = {"measured": "a one-layer copy ran to measure it",
       "trainer": "planned on a training run's measurements"}


def _budget(value: int | None) -> str:
    return "unlimited" if value is None else format_bytes(value)


def plan_text(pred: Prediction, hw: Hardware) -> str:
    """The ``[Predicted plan]`` block of one prediction."""
    pl = pred.placement
    streamed = pl.weights.resident < pl.stages
    below = list(pl.peaks)[1] if len(pl.peaks) > 1 else "-"
    acts = {"keep": "kept (nothing recomputed)",
            "recompute": f"rotor recomputes {pl.recomputed} stage forwards per micro-batch",
            "offload": f"saved activations offloaded to {below} and fetched back"
                       + (f"; rotor recomputes {pl.recomputed} stage forwards"
                          if pl.recomputed else ""),
            "offload+recompute": f"stage boundaries offloaded to {below}; {pl.recomputed} "
                                 f"stage forwards recomputed per micro-batch"}
    rows: list[tuple[str, object]] = [
        ("model", f"{pred.model}: {pred.params / 1e9:.2f}B parameters, {pl.stages} stages"),
        *([("trains", f"{pred.trainable:,} of {pred.params:,} parameters "
                      f"({pred.trainable / pred.params:.1%}; {pred.selection})"
                      + (f"; the first {pred.forward_only} stages run forward only, without "
                         f"a backward" if pred.forward_only else ""))]
          if pred.selection else []),
        ("hardware", f"{hw.name}: {hw.about}"),
        ("efficiency", EFFICIENCY.get(pred.costs) or "; ".join(hw.notes)),
        ("precision", pred.precision),
        ("tokens per step",
         f"{pred.tokens_per_step:,} ({pred.batch} x {pred.grad_accum} x {pred.seq})"),
        ("weights", pl.describe("weights")
         + (f" (prefetched {pl.prefetch} stage(s) ahead)" if streamed else "")),
        ("gradients", pl.describe("grads")),
        ("optimizer states", pl.describe("optimizer")
         + (", updated on the host" if pl.optimizer.resident < pl.stages and hw.has_gpu
            else "")),
        ("activations", acts[pl.activations]
         + (f"; {pl.selective} stages selective (matmul and attention outputs kept, the rest "
            "recomputed in their backward)" if pl.selective else "")),
    ]
    rows += [(f"peak {tier}", f"{format_bytes(peak)} of {_budget(pl.budgets[tier])}")
             for tier, peak in pl.peaks.items()]
    rows += [("step time", f"{pred.step_time:.3g} s"),
             ("tokens/s", f"{format_rate(pred.tokens_per_second)}"),
             ("MFU", (f"{100 * pred.mfu:.1f}% of {pred.peak_flops / 1e12:.3g} TFLOP/s "
                      f"({pred.matmul_dtype} peak), {pred.flops_per_token / 1e9:.3g} "
                      f"GFLOP/token")),
             ("busy per step", ", ".join(f"{k} {v:.3g} s" for k, v in pl.times.items()
                                         if v > 0 or k == "compute")),
             ("bottleneck", pl.bottleneck),
             ("smallest budgets", smallest_text(pl.smallest, pl.budgets))]
    rows += [("note", note) for note in pl.notes]
    return section(f"Plan: PREDICTED, {RAN.get(pred.costs, 'nothing was run')}", rows)


def smallest_text(smallest: dict[str, int | None], budgets: dict[str, int | None]) -> str:
    """``gpu 12.3 GiB (with ram 64 GiB); ram 20 GiB (with gpu 24 GiB)``."""
    parts = []
    for tier, value in smallest.items():
        others = ", ".join(f"{t} {_budget(b)}" for t, b in budgets.items() if t != tier)
        text = "none works" if value is None else format_bytes(value, round_up=True)
        parts.append(f"{tier} {text}" + (f" (with {others})" if others else ""))
    return "; ".join(parts)
