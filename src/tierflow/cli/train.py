"""``tierflow train``: one argparse flag per ``TrainOptions`` field, with its help, the merge
of defaults, ``--config FILE`` and the flags given (see ``train/options.py`` for the rules),
and the run: checked before torch is imported, then ``train.loop.train``.
"""
from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path
from typing import Any

import tomllib

from ..core.config import DEFAULT_CLIP
from ..core.errors import TierflowError
from ..precision.config import CHOICES
from ..train.options import (
    DTYPES,
    HOST_UPDATES,
    OPTIMIZER_STATES,
    RECOMPUTE,
    STREAM,
    TrainOptions,
    flag_of,
)
from .args import ENFORCE_HELP, UNENFORCED_OK_HELP, memory_size


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


_HELP = {
    "model": ("SPEC", "a preset (llama-20m, llama-134m, gpt2-124m, ...) or a local Hugging Face "
                      "directory (config.json + model.safetensors)"),
    "data": ("DIR", "a directory written by 'tierflow tokenize'"),
    "ram": ("SIZE", "RAM budget for the training step, e.g. 4GiB; a bare number is GiB "
                    "(default: none)"),
    "gpu": ("SIZE", "GPU budget, e.g. 8GiB (a bare number is GiB): train on the CUDA GPU, "
                    "host RAM (--ram) below it"),
    "simulate_gpu": (None, "with --gpu: plan and run on the CPU as if it were a GPU of that "
                           "size (host RAM and --disk below it), to try a GPU plan without one"),
    "disk": ("DIR", "an existing directory for the disk tier: a scratch subdirectory there "
                    "(one per rank under torchrun), removed at the end, holds the weights and "
                    "AdamW states that do not fit the budgets between uses (checkpoints still "
                    "go to --out); --resume keeps the run's --disk unless given, 'none' for no "
                    "disk tier. Who steps AdamW: see the end of this help"),
    "seq_len": ("N", "tokens per sequence (default 256)"),
    "allow_other_tokenizer": (None, "train on --data tokenized with another tokenizer than "
                                    "the model directory's (refused by default: the ids "
                                    "would mean other tokens)"),
    "batch_size": ("N", "sequences per micro-batch over all ranks (the global batch): under "
                        "torchrun each rank takes batch-size / ranks of them (default 4)"),
    "grad_accum": ("N", "micro-batches per optimizer step (default 1)"),
    "steps": ("N", "optimizer steps (default 100, or from --epochs)"),
    "epochs": ("F", "passes over train.bin, in tokens (instead of --steps)"),
    "lr": ("F", "peak learning rate (default 3e-4)"),
    "warmup": ("N", "linear warmup steps (default 5%% of the steps)"),
    "min_lr": ("F", "learning rate at the end of the cosine decay (default lr/10)"),
    "weight_decay": ("F", "AdamW weight decay on matrices (default 0.1)"),
    "clip": ("F", f"clip the global gradient norm to F; 0 disables (default {DEFAULT_CLIP})"),
    "seed": ("N", "seed of the init and the batches (default 0)"),
    "eval_every": ("N", "evaluate every N steps; 0 disables (default 100)"),
    "eval_steps": ("N", "eval batches per evaluation (default 10)"),
    "save_every": ("N", "checkpoint every N steps; 0: only at the end (default 0)"),
    "out": ("DIR", "where checkpoints and the log go (default ./out; with --resume, the "
                   "checkpoint's run directory)"),
    "resume": ("DIR", "continue from a checkpoint (a step_N directory or a run's --out); "
                      "options not given are the checkpoint's run's"),
    "log": ("FILE", "the JSONL log (default OUT/log.jsonl); under torchrun write --log-file, "
                    "as torchrun takes --log for its own --log-dir"),
    "dtype": (None, "bf16 autocast or fp32 (auto: bf16 where the CPU has native bf16); the "
                    "older name of --matmul-dtype"),
    "model_dtype": (None, "weight and gradient storage (default fp32); bf16 needs bf16 or fp8 "
                          "matmuls"),
    "master": (None, "with bf16 weights: keep an fp32 master copy in the optimizer (fp32, "
                     "default) or update the bf16 weights by stochastic rounding (none); "
                     "under torchrun write --master-copy, as torchrun takes --master for its "
                     "own --master-addr"),
    "optim_dtype": (None, "AdamW moment storage: fp32 (default), bf16 (stochastic rounding) or "
                          "int8 (blockwise, a float32 scale per 256)"),
    "matmul_dtype": (None, "matmuls: fp32, bf16 autocast, or fp8 (e4m3 decoder Linears through "
                           "torch._scaled_mm inside bf16 autocast; on a CPU, fp32 matmuls of the "
                           "fp8 operands); default from --dtype"),
    "fp8_grad": (None, "gradient matmuls of fp8 Linears: bf16 (default) or e5m2"),
    "compile": (None, "torch.compile the decoder layers"),
    "recompute": (None, "activation recomputation: auto (the planner), none or all"),
    "freeze": ("GLOBS", "freeze the parameters whose names match one of these comma-separated "
                        "globs, e.g. 'model.embed_tokens.*,model.layers.[0-9].*' (names as "
                        "model.named_parameters() gives them): no gradient, no optimizer "
                        "state, and the layers before the first that trains run forward only"),
    "train_only": ("GLOBS", "train only the parameters whose names match one of these "
                            "comma-separated globs, e.g. 'model.layers.21.*,lm_head.*'; every "
                            "other one is frozen (--freeze may then freeze some of them too)"),
    "lora": ("RANK", "fine-tune LoRA adapters of this rank (peft's, e.g. 16) on the frozen "
                     "model: only the adapters train (AdamW), the base weights take no gradient "
                     "and, with --disk, stream from there and are never written back; "
                     "checkpoints are PEFT adapter directories (adapter_config.json, "
                     "adapter_model.safetensors) that peft.PeftModel.from_pretrained loads"),
    "lora_alpha": ("F", "with --lora: the adapters' scale is alpha / rank (default: the rank, "
                        "a scale of 1)"),
    "lora_dropout": ("P", "with --lora: dropout on the adapters' input (default 0)"),
    "lora_targets": ("NAMES", "with --lora: the modules that get adapters, comma-separated "
                              "names or name suffixes, e.g. 'q_proj,v_proj' (default "
                              "all-linear: every Linear of the decoder layers, the attention "
                              "and MLP projections; the LM head never)"),
    "merge": (None, "with --lora: the run's last checkpoint also holds merged/, the model "
                    "with the adapters merged into its weights: a Hugging Face checkpoint "
                    "that AutoModelForCausalLM loads alone (written a tensor at a time)"),
    "tensorboard": ("DIR", "also write TensorBoard event files (loss, grad norm, lr, tok/s, "
                           "RAM, eval loss) to DIR"),
    "stream": (None, "with --disk: auto streams the weights of the fewest stages that make the "
                     "step fit --ram (the planner's choice), all streams every stage's weights "
                     "and keeps the optimizer states on disk"),
    "prefetch": ("N", "with --disk: stages whose weights, optimizer states and tapes are read "
                      "ahead of the one computing (default: the planner's choice, the fastest "
                      "that fits --ram; 0 reads each on demand; checkpoints stashed on disk "
                      "are always read one backward ahead)"),
    "serial_reads": (None, "with --disk: run the plan made for its prefetch depth with every "
                           "weight, optimizer state and tape read on demand, to measure what "
                           "reading ahead saves (the [Plan] prediction still assumes it)"),
    "host_updates": (None, "tierflow's own AdamW under --gpu: auto lets the "
                           "planner step it in host RAM, on the CPU, for the stages whose "
                           "optimizer states live there or on disk (their gradients go down and "
                           "their new weights up, or back to disk, instead of the states coming "
                           "up and back), never keeps every update on the GPU, all steps every "
                           "such stage there"),
    "optimizer_states": (None, "tierflow's own AdamW (with --disk or --gpu): the tier where "
                               "its states live between updates: auto lets the planner choose, "
                               "compute "
                               "keeps them on the GPU (or, without --gpu, in RAM), ram in the "
                               "host RAM below --gpu, disk in --disk DIR"),
    "enforce": (None, ENFORCE_HELP),
    "unenforced_ok": (None, UNENFORCED_OK_HELP),
    "trace": ("FILE", "write a Chrome-trace JSON of every step (compute, disk reads and "
                      "writes, optimizer, gradient averaging, the RSS as a counter), for "
                      "Perfetto or chrome://tracing; under torchrun rank r > 0 writes "
                      "FILE with .rank<r> before its suffix"),
    "dist_timeout": ("S", "under torchrun: seconds a rank waits for the others before it "
                          "stops with an error naming the rank that died (default 300)"),
    "config": ("FILE", "a TOML file of options; flags win over it"),
}
# the rule of train/roles.py, as the help says it
OWNERSHIP = ("Who steps AdamW: in a run with a disk tier (--disk DIR) or a GPU (--gpu) "
             "tierflow owns it, one AdamW per stage stepped during the backward or right after "
             "it, its states on the tier the plan (or --optimizer-states, --host-updates) "
             "chooses, as tierflow plan predicts; the model starts on disk, or in host RAM "
             "under --gpu unless its weights pass --ram or leave too little of it, and streams "
             "to the compute tier; under torchrun every rank holds the whole model and its "
             "states (replicas, gradients averaged). In RAM without a disk tier the trainer "
             "steps AdamW with every state there (reserved in the plan); under torchrun its "
             "states are sharded (ZeRO-2).")
_TYPES = {"seq_len": _int, "batch_size": _int, "grad_accum": _int, "steps": _int,
          "epochs": _float, "lr": _float, "warmup": _int, "min_lr": _float,
          "weight_decay": _float, "clip": _float, "seed": _int, "eval_every": _int,
          "eval_steps": _int, "save_every": _int, "dist_timeout": _float, "prefetch": _int,
          "lora": _int, "lora_alpha": _float, "lora_dropout": _float}


_CHOICES = {**CHOICES, "dtype": DTYPES, "recompute": tuple(RECOMPUTE), "stream": STREAM,
            "host_updates": HOST_UPDATES, "optimizer_states": OPTIMIZER_STATES}
# second names for the flags that torchrun would take as an abbreviation of one of its own
# options (it parses its command line, the training script's arguments included, with
# argparse's prefix matching, so `--log` is "ambiguous: --log-dir, --logs-specs" there)
_ALIASES = {"log": ("--log-file",), "master": ("--master-copy",)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option as a flag; defaults are None so that the merge knows what was given."""
    for f in fields(TrainOptions):
        if f.name == "given":
            continue
        metavar, help_text = _HELP[f.name]
        names = (flag_of(f.name), *_ALIASES.get(f.name, ()))
        if f.name in ("compile", "simulate_gpu", "serial_reads", "allow_other_tokenizer",
                      "enforce", "unenforced_ok", "merge"):
            parser.add_argument(*names, dest=f.name, action="store_true", default=None,
                                help=help_text)
        elif f.name in _CHOICES:
            parser.add_argument(*names, dest=f.name, choices=_CHOICES[f.name],
                                default=None, help=help_text)
        else:
            parser.add_argument(*names, dest=f.name, type=_TYPES.get(f.name, str),
                                default=None, metavar=metavar, help=help_text)


def from_args(args: argparse.Namespace) -> TrainOptions:
    """Defaults, then the TOML file of ``--config``, then the flags given, sizes with their
    unit (``memory_size``); checked as far as they can be without torch (``check_flags``;
    the run validates the rest)."""
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values.update(read_toml(Path(args.config)))
    for f in fields(TrainOptions):
        given = getattr(args, f.name, None)
        if given is not None:
            values[f.name] = given
    for name in ("ram", "gpu"):  # a bare number is GiB, from a flag or the file
        if values.get(name) is not None:
            values[name] = memory_size(values[name], flag_of(name))
    return TrainOptions(**values, given=frozenset(values)).check_flags()


def read_toml(path: Path) -> dict[str, Any]:
    """The options of the TOML file ``path``, keyed by field name, with the types the flags
    would give (sizes and paths as strings, a list of globs joined); one line if it is
    missing, unreadable, not TOML or names an unknown option."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TierflowError(f"--config {path} does not exist: give a TOML file") from None
    except OSError as e:
        raise TierflowError(f"cannot read --config {path} ({e.strerror})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise TierflowError(f"--config {path} is not valid TOML ({e})") from None
    known = {f.name for f in fields(TrainOptions)} - {"config", "given"}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in known:
            raise TierflowError(f"--config {path} has an unknown option {key!r}: known options "
                                f"are {', '.join(sorted(k.replace('_', '-') for k in known))}")
        if name in ("ram", "gpu", "disk", "model", "data", "out", "resume", "log", "tensorboard",
                    "trace") \
                and value is not None:
            value = str(value)
        if name in ("freeze", "train_only", "lora_targets") and isinstance(value, list) \
                and all(isinstance(v, str) for v in value):
            value = ",".join(value)  # a TOML list of globs
        if name in ("epochs", "lr", "min_lr", "weight_decay", "clip", "dist_timeout",
                    "lora_alpha", "lora_dropout") \
                and isinstance(value, int) \
                and not isinstance(value, bool):
            value = float(value)
        out[name] = value
    return out


def register(sub: Any) -> None:
    """Add ``tierflow train`` to the subcommands ``sub``."""
    train = sub.add_parser(
        "train", help="train a causal LM on token files inside a memory budget",
        description="Train a preset (random init) or a local Hugging Face model on the token "
                    "files of 'tierflow tokenize', planned by tierflow under --ram; evaluate, "
                    "checkpoint (every --save-every steps, at the end, on Ctrl-C) and resume "
                    "exactly. Any flag can also come from --config FILE.toml; flags win.",
        epilog=OWNERSHIP)
    add_arguments(train)
    train.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Train; under torchrun, end this rank's process the way ``dist.exit_rank`` says."""
    from ..core.torchrun_env import world_size_from_env
    from ..train.preflight import preflight
    opts = from_args(args)
    preflight(opts)  # bad input fails here, before the seconds of importing torch
    from ..distributed import exit_rank
    from ..train.loop import train
    code = train(opts)
    if world_size_from_env() > 1:  # a torchrun rank whose run is over: see exit_rank
        exit_rank(code)
    return code
