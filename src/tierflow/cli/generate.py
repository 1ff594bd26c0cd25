"""``tierflow generate``: stream a sampled continuation of a prompt (or, with ``--chat``, the
reply to a user message through the tokenizer's chat template) from a checkpoint (the work
is ``generate/sample.py``'s; bad input is refused by ``generate/options.py`` before torch is
imported)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .args import add_checkpoint_argument, add_enforce_arguments, bounded_number, memory_size


def register(sub: Any) -> None:
    """Add ``tierflow generate`` to the subcommands ``sub``."""
    from ..generate.options import DEFAULT_MAX_NEW_TOKENS, DEFAULT_TEMPERATURE
    gen = sub.add_parser(
        "generate", help="sample text from a checkpoint with a KV cache",
        description="Load a causal LM directory (config.json, model.safetensors, tokenizer.json; "
                    "e.g. OUT/step_N from tierflow train), print the prompt and stream the "
                    "continuation, sampled token by token with a KV cache, then a line with "
                    "tokens/s. With --chat, each prompt is a user message: its chat template "
                    "renders it and only the reply is printed. An int8 copy written by "
                    "tierflow quantize loads the same way.")
    add_checkpoint_argument(gen)
    gen.add_argument("--prompt", required=True, action="append", metavar="TEXT",
                     help="the text to continue (with --chat: the user's message); repeat "
                          "--prompt for several, each generated in turn by the model loaded "
                          "once")
    gen.add_argument("--chat", action="store_true",
                     help="each prompt is a user message: the tokenizer's chat template "
                          "(tokenizer_config.json or chat_template.jinja beside "
                          "tokenizer.json) renders it with the generation prompt, generation "
                          "stops at the template's end token (the tokenizer's eos and "
                          "generation_config.json's eos ids) and only the reply is printed")
    gen.add_argument("--max-new-tokens", type=bounded_number(int, "tokens to generate", 1),
                     default=DEFAULT_MAX_NEW_TOKENS, metavar="N",
                     help=f"tokens to generate at most (default {DEFAULT_MAX_NEW_TOKENS})")
    gen.add_argument("--temperature", type=bounded_number(float, "0 is greedy", 0.0),
                     default=DEFAULT_TEMPERATURE, metavar="F",
                     help=f"sampling temperature; 0 picks the most likely token "
                          f"(default {DEFAULT_TEMPERATURE})")
    gen.add_argument("--top-k", type=bounded_number(int, "the K most likely tokens", 1),
                     default=None, metavar="K",
                     help="sample among the K most likely tokens only")
    gen.add_argument("--seed", type=bounded_number(int, "a random seed", 0), default=None,
                     metavar="N",
                     help="random seed: the same seed gives the same text (default: random)")
    gen.add_argument("--tokenizer", type=Path, default=None, metavar="PATH",
                     help="tokenizer.json or a directory holding one (default DIR/tokenizer.json)")
    gen.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                     help="weights and compute dtype (auto: bf16 where the CPU has native bf16)")
    gen.add_argument("--ram", default=None, metavar="SIZE",
                     help="RAM budget, e.g. 1GiB (a bare number is GiB): below what the "
                          "whole model needs, decoder layers are read from the checkpoint for "
                          "every token (the plan is printed on stderr); refused, naming the "
                          "smallest budget, when even that does not fit")
    add_enforce_arguments(gen)
    gen.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Stream the prompt and its continuation to stdout, then the tokens/s line."""
    from ..generate.options import GenerateRequest, check_request
    ram = memory_size(args.ram, "--ram") if args.ram is not None else None
    request = GenerateRequest.of(
        args.model, args.prompt, tokenizer=args.tokenizer, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, seed=args.seed, dtype=args.dtype,
        ram=ram, chat=args.chat, enforce=bool(args.enforce),
        unenforced_ok=bool(args.unenforced_ok))
    check_request(request)  # bad input fails before torch loads
    from ..generate.sample import run as generate
    generate(request)
    return 0
