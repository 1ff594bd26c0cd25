#!/usr/bin/env python3
"""docs/models.md from the registry test's results: every model type of transformers'
causal-LM mapping, trained exactly by tierflow or refused, and why.

    .venv/bin/python benchmarks/models_table.py [--results FILE] [--out docs/models.md]

Runs tests/test_registry.py (about a minute on 2 cores) with $TIERFLOW_REGISTRY_RESULTS set,
so that each family's test writes its outcome as a JSON line, unless ``--results`` names a
file such a run wrote; the test must pass. Then writes the table: each model type, its causal
LM class, whether it trains exactly (and with which head stage) or the one-line reason
tierflow refuses it, the transformers and torch versions, and the share of the decoder-only
families that train exactly.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADS = {
    "fused": "fused head + loss",
    "model's own": "the model's own head code",
    "body's own": "the model's own code after its last layer",
}


def run_registry(results: Path) -> None:
    """tests/test_registry.py with its outcomes written to ``results``; exits if it fails."""
    env = {**os.environ, "TIERFLOW_REGISTRY_RESULTS": str(results),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    test = str(ROOT / "tests" / "test_registry.py")
    code = subprocess.call([sys.executable, "-m", "pytest", test, "-q", "-p", "no:cacheprovider"],
                           cwd=ROOT, env=env)
    if code != 0:
        sys.exit(f"tests/test_registry.py failed (exit code {code}): fix it before the table")


def read_outcomes(results: Path) -> dict[str, dict]:
    outcomes = {}
    for line in results.read_text().splitlines():
        record = json.loads(line)
        outcomes[record["model_type"]] = record
    return outcomes


def table(outcomes: dict[str, dict]) -> str:
    """The Markdown of docs/models.md."""
    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    sys.path.insert(0, str(ROOT / "tests"))
    from test_registry import NOT_DECODER_ONLY, UNBUILDABLE

    families = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    missing = [f for f in families if f not in outcomes]
    if missing:
        sys.exit(f"no outcome for {', '.join(missing)}: run the whole registry test")
    exact = [f for f in families if outcomes[f]["exact"]]
    decoder_only = [f for f in families if f not in NOT_DECODER_ONLY]
    exact_decoders = [f for f in decoder_only if outcomes[f]["exact"]]
    lines = [
        "# Model families",
        "",
        "Every model type in transformers' causal-LM mapping "
        "(`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`), as `tests/test_registry.py` finds it: a tiny "
        "model of the family (2-4 layers, hidden 64, vocab 256, dropout 0.1 and router "
        "losses on where it has them) fitted with `tierflow.fit` at two budgets, one keeping "
        "every activation and one recomputing every stage, two steps each against plain "
        "PyTorch in fp32: the loss and every parameter's gradient equal (`assert_close`), the "
        "RNG left where the plain step leaves it. Or tierflow refuses it before any step, in "
        "one line naming it (`UnsupportedModelError`; exit code 2 from the command line); the "
        "reason is the one a user sees. A multimodal model is built through its text model, "
        "as its text part is fine-tuned.",
        "",
        f"transformers {transformers.__version__}, torch {torch.__version__}. Written by "
        "`benchmarks/models_table.py` from the test's results.",
        "",
        f"- {len(exact)} of {len(families)} model types train exactly;",
        f"- of the {len(decoder_only)} decoder-only causal LMs, {len(exact_decoders)} "
        f"({100 * len(exact_decoders) / len(decoder_only):.1f}%) train exactly; the "
        f"{len(families) - len(decoder_only)} others are marked below (encoders with a "
        "causal-LM option, decoders of encoder-decoder models, ...).",
        "",
        "Head: *fused head + loss* computes the logits in chunks inside the loss, so the "
        "(tokens x vocab) logits never exist whole (final-logit soft-capping and a mixture of "
        "experts' auxiliary loss included); the others run the model's own code after its "
        "last layer, which holds the whole logits.",
        "",
        "| model type | causal LM | trains exactly | head, or why not |",
        "|---|---|---|---|",
    ]
    for family in families:
        outcome = outcomes[family]
        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family]
        via = f" (through `{outcome['via']}`)" if outcome["via"] else ""
        kind = f" *{NOT_DECODER_ONLY[family]}*" if family in NOT_DECODER_ONLY else ""
        if outcome["exact"]:
            verdict, note = "yes", HEADS[outcome["head"]] + via
        elif family in UNBUILDABLE:
            verdict, note = "-", outcome["reason"]
        else:
            verdict, note = "refused", outcome["reason"].replace("|", "\\|") + via
        lines.append(f"| `{family}`{kind} | `{name}` | {verdict} | {note} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, help="JSON lines a registry test run wrote")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "models.md")
    args = parser.parse_args()
    if args.results is None:
        with tempfile.TemporaryDirectory() as scratch:
            results = Path(scratch) / "registry.jsonl"
            run_registry(results)
            outcomes = read_outcomes(results)
    else:
        outcomes = read_outcomes(args.results)
    args.out.write_text(table(outcomes))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
