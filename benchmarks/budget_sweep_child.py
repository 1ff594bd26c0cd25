#!/usr/bin/env python3
"""One process of ``budget_sweep.py``: plain PyTorch's peak for a sweep's model and mode, or
the ResNet trained through ``tierflow.fit`` under a RAM budget. Prints one JSON line.

    budget_sweep_child.py plain --model SPEC --mode ram|disk|bf16|accum|frozen|generate \\
        --seq N --batch N --steps N [--new-tokens N --prompt TEXT]
    budget_sweep_child.py fit --model resnet --ram BYTES --steps N [--enforce]

The peak is the process's peak RSS above its RSS right after the imports (transformers'
model code included, as ``tierflow train`` takes its baseline). Plain PyTorch trains what
``tierflow train`` would in that mode: bf16 autocast where the CPU has native bf16; ``bf16``
with bf16 weights and AdamW moments (here: AdamW over the bf16 parameters), ``accum`` with
two micro-batches per step, ``frozen`` with the first two decoder layers frozen; ``disk``
is plain PyTorch in RAM (it has no disk tier); ``generate`` is Hugging Face ``generate``
(greedy, ``--new-tokens`` after ``--prompt``) of the checkpoint directory SPEC loaded whole
in bf16 by ``AutoModelForCausalLM``.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import sys

FROZEN = ("*.0.*", "*.1.*")  # budget_sweep.py's --freeze globs
# images large enough that plain PyTorch's peak (its activations) passes tierflow's own
# runtime: at 16 images of 64x64 it was 146 MiB, and tierflow refused half of it
RESNET_BATCH, RESNET_SIZE = 32, 128


def resnet():
    """A ResNet of basic blocks (3 stages, 2 blocks each, 32-64-128 channels), 10 classes:
    torchvision's shape without torchvision."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int):
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                nn.ReLU(), nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
            self.skip = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            self.relu = nn.ReLU()

        def forward(self, x):
            return self.relu(self.body(x) + self.skip(x))

    layers = [nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU()]
    cin = 32
    for cout, stride in ((32, 1), (64, 2), (128, 2)):
        layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10)]
    return nn.Sequential(*layers)


def plain_generate(args: argparse.Namespace) -> int:
    """Hugging Face generation with every weight in RAM: the peak above the baseline."""
    import torch
    from transformers import AutoModelForCausalLM

    from tierflow.data.tokenizer import load_tokenizer
    from tierflow.exec.memory import rss_bytes
    from tierflow.profile.machine import maxrss_bytes
    base = rss_bytes()  # as tierflow generate's child (a high-water mark of the imports
    # could hide a small model's whole generation)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    ids = load_tokenizer(f"{args.model}/tokenizer.json").encode(args.prompt).ids
    with torch.inference_mode():
        model.generate(torch.tensor([ids]), max_new_tokens=args.new_tokens, do_sample=False,
                       min_new_tokens=args.new_tokens)
    print(json.dumps({"what": "plain", "model": args.model, "mode": "generate",
                      "peak": maxrss_bytes() - base}), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["plain", "fit"])
    p.add_argument("--model", required=True)
    p.add_argument("--mode", default="ram")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--ram", type=int, default=None)
    p.add_argument("--enforce", action="store_true")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--prompt", default="")
    args = p.parse_args()
    if args.mode == "generate":
        return plain_generate(args)

    import torch
    import transformers.modeling_utils  # noqa: F401  (part of the baseline, as the trainer's)

    import tierflow
    from tierflow.core.units import budget_to_give
    from tierflow.exec.memory import rss_bytes
    from tierflow.profile.machine import default_matmul_dtype, maxrss_bytes
    base, base_rss = maxrss_bytes(), rss_bytes()
    bf16 = default_matmul_dtype() == "bf16"
    torch.manual_seed(0)
    if args.model == "resnet":
        model = resnet()
        images = torch.randn(RESNET_BATCH, 3, RESNET_SIZE, RESNET_SIZE)
        labels = torch.randint(0, 10, (RESNET_BATCH,))
        batch = images
        loss_of = lambda out: torch.nn.functional.cross_entropy(out, labels)  # noqa: E731
    else:
        model = tierflow.load_model(args.model, dtype=torch.float32)
        ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq + 1))
        batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
        loss_of = lambda out: out.loss  # noqa: E731
        if args.mode == "bf16":
            model.to(torch.bfloat16)
        if args.mode == "frozen":
            for name, param in model.named_parameters():
                if any(fnmatch.fnmatch(name, g) for g in FROZEN):
                    param.requires_grad_(False)
    micro = 2 if args.mode == "accum" else 1
    autocast = lambda: torch.autocast("cpu", torch.bfloat16, enabled=bf16)  # noqa: E731
    call = (lambda m: m(**batch)) if isinstance(batch, dict) else (lambda m: m(batch))
    factory = lambda ps: torch.optim.AdamW(ps, lr=1e-4)  # noqa: E731
    record = {"what": args.what, "model": args.model, "mode": args.mode}
    if args.what == "plain":
        opt = factory([q for q in model.parameters() if q.requires_grad])
        for _ in range(args.steps):
            for _ in range(micro):
                with autocast():
                    (loss_of(call(model)) / micro).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        record["peak"] = maxrss_bytes() - base
    else:
        try:
            with autocast():
                module = tierflow.fit(model, batch, ram=args.ram, optimizer=factory,
                                      baseline=base_rss,
                                      config=tierflow.FitConfig(enforce=args.enforce))
        except tierflow.BudgetError as e:
            print(f"tierflow: error: {e}; give ram={budget_to_give(e.smallest)}",
                  file=sys.stderr)
            return 2
        for _ in range(args.steps):
            with autocast():
                loss_of(call(module)).backward()
        record.update(status="ok", budget=args.ram, peak_above_baseline_bytes=maxrss_bytes()
                      - base, predicted_peak_bytes=int(module.plan.predicted_peak),
                      strategy=module.plan.strategy)
    print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
