"""Does tierflow train a model family exactly? ``check(model_type)`` answers for one family of
transformers' causal-LM mapping, on the tiny model of registry_configs.py.

The family's tiny model (dropout on, router logits on) is fitted at two budgets: keep-all
and checkpoint-all (every stage recomputed in backward). At each, two steps from fixed seeds
must give plain PyTorch's loss and every parameter's gradient (fp32, assert_close's
defaults unless ``TOLERANCES`` says otherwise, with the reason), and leave the RNG where the
plain step leaves it. Or ``tierflow.fit`` refuses the family before any step: an
UnsupportedModelError naming it, whose reason the outcome keeps.
"""
from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import asdict, dataclass

import torch

import tierflow
from registry_configs import VOCAB, tiny_model
from tierflow.chain.base import UnsupportedModelError
from tierflow.core.config import FitConfig

PLANNERS = ("keep-all", "checkpoint-all")
# the planner is given, so the profile's times choose nothing: one timed round a stage (its
# memory round and warm-up as ever) halved the check of eight families (26.6 -> 13.0 s)
PROFILE_ONCE = {"profile_repeats": 1, "profile_seconds": 0.0}
BATCH, SEQ = 2, 16

# Where the fused head's fp32 rounding (its sums run in another order) is amplified beyond
# assert_close's defaults by what comes before it; the model's own head is exact there.
TOLERANCES: dict[str, dict[str, float]] = {
    # RWKV's WKV recurrence (exponentials of the time decay) scales the head's 1e-7 relative
    # differences up to 1e-4 in a few embedding rows' gradients
    "rwkv": dict(rtol=1e-3, atol=1e-4),
}


# What each kind of head stage is called in docs/models.md
HEADS = {"FusedHead": "fused", "ModelTailHead": "model's own", "BodyTailHead": "body's own"}


@dataclass(frozen=True)
class Outcome:
    model_type: str
    via: str  # the model type built instead (a multimodal model's text model), or ""
    exact: bool
    head: str  # the kind of head stage (HEADS) when exact, else ""
    reason: str  # the refusal's reason ("" when exact)
    message: str  # the refusal's whole line ("" when exact)
    seconds: float


def record(outcome: Outcome) -> None:
    """Append ``outcome`` as a JSON line to the file $TIERFLOW_REGISTRY_RESULTS names, if any
    (benchmarks/models_table.py reads it)."""
    path = os.environ.get("TIERFLOW_REGISTRY_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(asdict(outcome)) + "\n")


def sample() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # a masked prompt
    return {"input_ids": ids, "labels": labels, "use_cache": False}


def check(model_type: str) -> Outcome:
    """Fit the family's tiny model at each of PLANNERS and compare with plain PyTorch; raises
    AssertionError when a fitted step differs."""
    started = time.perf_counter()
    tiny = tiny_model(model_type)
    head, reason, message = _check_built(tiny.via or model_type, tiny.model)
    return Outcome(model_type, tiny.via, bool(head), head, reason, message,
                   time.perf_counter() - started)


def _check_built(key: str, model: torch.nn.Module) -> tuple[str, str, str]:
    """(head kind, "", "") when every planner trains exactly, ("", reason, message) when
    tierflow refuses the family."""
    data = sample()
    reference = copy.deepcopy(model)
    tolerance = TOLERANCES.get(key, {})
    for planner in PLANNERS:
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        try:
            module = tierflow.fit(model, data,
                                  config=FitConfig(planner=planner, **PROFILE_ONCE))
        except UnsupportedModelError as refusal:
            assert planner == PLANNERS[0], f"{key}: refused only at {planner}: {refusal}"
            return "", refusal.reason, str(refusal)
        if planner == "checkpoint-all":
            assert module.plan.recomputed_stages(), f"{key}: {planner} recomputes nothing"
        for seed in (1, 2):
            torch.manual_seed(seed)
            expected = reference(**data).loss
            expected.backward()
            after_plain = torch.rand(1)
            torch.manual_seed(seed)
            loss = module(**data).loss
            loss.backward()
            after_fit = torch.rand(1)
            torch.testing.assert_close(loss, expected, **tolerance,
                                       msg=lambda m: f"{key} {planner} loss: {m}")
            assert torch.equal(after_plain, after_fit), f"{key} {planner}: RNG stream moved"
        want = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
        got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert got.keys() == want.keys(), f"{key} {planner}: {sorted(got.keys() ^ want.keys())}"
        for name, grad in want.items():
            torch.testing.assert_close(got[name], grad, **tolerance,
                                       msg=lambda m, n=name: f"{key} {planner} {n}: {m}")
    return HEADS[type(module.chain.stages[-1]).__name__], "", ""
