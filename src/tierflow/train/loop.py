"""``tierflow train``: the training loop around ``tierflow.fit``.

One run: check the options, the data and the output directory (cheap, before anything slow);
build or load the model; plan the step with ``tierflow.fit`` (gradients accumulate in
``.grad``, the AdamW state is ``reserve``d in the plan); then per optimizer step:
``grad_accum`` micro-batches forward and backward, global-norm clipping, AdamW with the
warmup + cosine schedule, one ``[T]`` line and one JSON record. ``[V]`` evaluations every
``--eval-every`` steps; checkpoints every ``--save-every`` steps, at the end and on Ctrl-C.

Resuming restores the weights, the AdamW state, the data stream position and every RNG, so
the resumed steps are bit-identical (fp32) to an uninterrupted run's.
"""
from __future__ import annotations

import contextlib
import json
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import TierflowError
from ..paths import require_writable_dir
from ..units import format_bytes, parse_bytes
from .options import RECOMPUTE, TrainOptions
from .sol import cpu_model, model_flops_per_token, peak_matmul_flops

INTERRUPTED = 130
DEFAULT_STEPS = 100


# ---------------------------------------------------------------- data directory

@dataclass
class DataDir:
    path: Path
    train: Any  # TokenFile
    eval: Any | None
    vocab_size: int
    tokenizer_file: Path | None
    max_token: int

    def identity(self) -> dict[str, Any]:
        tok = None
        if self.tokenizer_file is not None:
            import hashlib
            tok = hashlib.sha256(self.tokenizer_file.read_bytes()).hexdigest()[:16]
        return {"train_tokens": len(self.train), "eval_tokens": len(self.eval) if self.eval else 0,
                "vocab_size": self.vocab_size, "tokenizer": tok}


def open_data(path: str | Path) -> DataDir:
    from ..data.tokenfile import TokenFile
    path = Path(path)
    if not path.is_dir():
        what = "is a file" if path.exists() else "does not exist"
        raise TierflowError(f"--data {path} {what}: give a directory written by 'tierflow "
                            "tokenize' (train.bin, eval.bin, tokenizer.json)")
    if not (path / "train.bin").is_file():
        raise TierflowError(f"--data {path} has no train.bin: run 'tierflow tokenize INPUT... "
                            f"--out {path}' first")
    train = TokenFile.open(path / "train.bin")
    if len(train) == 0:
        raise TierflowError(f"{path / 'train.bin'} holds no tokens: tokenize a non-empty corpus")
    evalf = TokenFile.open(path / "eval.bin") if (path / "eval.bin").is_file() else None
    tokenizer_file = path / "tokenizer.json"
    tokenizer_file = tokenizer_file if tokenizer_file.is_file() else None
    vocab = None
    meta = path / "meta.json"
    if meta.is_file():
        try:
            vocab = int(json.loads(meta.read_text())["vocab_size"])
        except (ValueError, KeyError, TypeError):
            vocab = None
    if vocab is None and tokenizer_file is not None:
        try:
            from tokenizers import Tokenizer
            vocab = Tokenizer.from_file(str(tokenizer_file)).get_vocab_size(with_added_tokens=True)
        except Exception:
            vocab = None
    if vocab is None:
        vocab = train.vocab_size
    top = max(train.max_token() or 0, (evalf.max_token() or 0) if evalf is not None else 0)
    if vocab is None:
        vocab = top + 1
    if top >= vocab:
        raise TierflowError(f"--data {path} holds token id {top}, but its vocab size is {vocab}: "
                            "the token files and tokenizer do not belong together; tokenize again")
    return DataDir(path, train, evalf, int(vocab), tokenizer_file, top)


# ---------------------------------------------------------------- identity of a run

def _spec_arch(spec: str, vocab_size: int) -> dict[str, Any]:
    """The architecture ``--model spec`` names, read without loading any weight."""
    from ..models.load import _read_config
    from ..models.presets import PRESETS, preset_config
    if spec in PRESETS:
        return _config_arch(preset_config(spec, vocab_size=vocab_size))
    path = Path(spec)
    if not path.is_dir():
        raise TierflowError(f"--model {spec!r} is neither a preset nor a directory: pass the "
                            "model the checkpoint was trained from, or leave --model out")
    return _config_arch(_read_config(path))


def _model_arch(model) -> dict[str, Any]:
    return _config_arch(model.config)


def _config_arch(config) -> dict[str, Any]:
    config = config.to_dict()
    keep = ("model_type", "vocab_size", "hidden_size", "n_embd", "num_hidden_layers", "n_layer",
            "intermediate_size", "n_inner", "num_attention_heads", "n_head",
            "num_key_value_heads", "tie_word_embeddings")
    return {k: config[k] for k in keep if k in config}


def _differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    diffs = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += [f"{key} {d}" for d in _differences(a, b)]
        elif a != b:
            diffs.append(f"{key}: checkpoint {a!r}, now {b!r}")
    return diffs


# ---------------------------------------------------------------- the run

class _Interrupt:
    """SIGINT sets a flag the loop checks between steps; a second one interrupts at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> "_Interrupt":
        with contextlib.suppress(ValueError):  # not the main thread
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def train(opts: TrainOptions) -> int:
    """Run ``tierflow train`` with validated ``opts``; returns the exit code."""
    try:
        return _train(opts)
    except PermissionError as e:  # a file or directory the user may not read or write
        name = e.filename or "a file"
        raise TierflowError(f"cannot read {name} (permission denied): check its permissions "
                            "or copy it somewhere you can read") from None


def _train(opts: TrainOptions) -> int:
    import torch
    from transformers import AutoModelForCausalLM  # noqa: F401  (part of the RSS baseline)
    from .. import api, measure  # noqa: F401
    from ..models.load import load_model
    from ..models.presets import PRESETS
    from .checkpoint import load_checkpoint
    from .codec import config_hash
    from .logger import Logger

    baseline = measure.maxrss_bytes()

    # --- everything cheap first: resume state, data, output directory
    ckpt = load_checkpoint(opts.resume) if opts.resume else None
    if ckpt is not None:
        saved_opts = ckpt.trainer_state.get("options")
        if isinstance(saved_opts, dict):
            opts.inherit(saved_opts)
    opts.validate()
    data = open_data(opts.data)
    out = Path(opts.out) if opts.out else (ckpt.path.parent if ckpt is not None else Path("out"))
    opts.out = str(out)
    require_writable_dir(out, "--out")
    if opts.tensorboard:
        require_writable_dir(opts.tensorboard, "--tensorboard")
    log_path = Path(opts.log) if opts.log else out / "log.jsonl"
    budget = parse_bytes(opts.ram, what="--ram") if opts.ram else None
    dtype_name = opts.dtype if opts.dtype != "auto" else ("bf16" if measure.fast_bf16() else "fp32")

    # --- the model
    spec = opts.model
    if ckpt is not None:
        model = load_model(ckpt.path, dtype=torch.float32)
    elif spec in PRESETS:
        model = load_model(spec, vocab_size=data.vocab_size, dtype=torch.float32, seed=opts.seed)
    else:
        model = load_model(spec, dtype=torch.float32)
    with torch.no_grad():  # a sum is inf or nan when an element is (no mask of the model's size)
        bad = [(name, int((~torch.isfinite(p)).sum())) for name, p in model.named_parameters()
               if p.is_floating_point() and not math.isfinite(float(p.sum()))]
        bad = [(name, k) for name, k in bad if k]  # an overflowing sum of finite values
    if bad:
        where = ", ".join(f"{n} ({k} values)" for n, k in bad[:3])
        source = ckpt.path if ckpt is not None else spec
        raise TierflowError(f"the weights of {source} hold inf or nan in {where}"
                            f"{f' and {len(bad) - 3} more' if len(bad) > 3 else ''}: every loss "
                            "would be nan; use a checkpoint saved before the loss diverged or "
                            "the original model")
    model_vocab = int(model.config.vocab_size)
    if data.max_token >= model_vocab:
        raise TierflowError(f"--data {data.path} holds token id {data.max_token} but the model "
                            f"{spec} has vocab size {model_vocab}: use a model whose vocab has at "
                            f"least {data.max_token + 1} ids, or tokenize with its tokenizer")
    config = model.config
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if positions is not None and opts.seq_len > positions:
        raise TierflowError(f"--seq-len {opts.seq_len} is above the model's maximum positions "
                            f"({positions}): use --seq-len {positions} or less")
    model.train()

    arch = _model_arch(model)
    if ckpt is not None and "model" in opts.given:  # the checkpoint's weights, the given model
        arch = _spec_arch(spec, data.vocab_size)
    identity = {"model": arch, "data": data.identity(), "seq_len": opts.seq_len,
                "batch_size": opts.batch_size, "grad_accum": opts.grad_accum, "seed": opts.seed}
    run_hash = config_hash(identity)
    if ckpt is not None:
        saved = ckpt.trainer_state.get("identity")
        if ckpt.trainer_state.get("config_hash") != run_hash:
            diffs = _differences(saved, identity) if isinstance(saved, dict) else ["unknown run"]
            raise TierflowError(f"checkpoint {ckpt.path} is of a different run ("
                                f"{'; '.join(diffs[:4])}): resume with the model, data and "
                                "--seq-len/--batch-size/--grad-accum/--seed it was trained with, "
                                "or start a new run without --resume")

    tokens_per_step = opts.batch_size * opts.grad_accum * opts.seq_len
    if opts.steps is not None:
        total = opts.steps
    elif opts.epochs is not None:
        total = max(1, math.ceil(opts.epochs * len(data.train) / tokens_per_step))
    else:
        total = DEFAULT_STEPS
    warmup = opts.warmup if opts.warmup is not None else (total * 5) // 100
    min_lr = opts.min_lr if opts.min_lr is not None else opts.lr / 10

    logger = Logger(log_path, append=ckpt is not None)
    board = None
    try:
        if opts.tensorboard:
            from .tensorboard import EventWriter
            board = EventWriter(opts.tensorboard)
        return _run(opts=opts, data=data, out=out, logger=logger, budget=budget, board=board,
                    dtype_name=dtype_name, model=model, identity=identity, run_hash=run_hash,
                    ckpt=ckpt, total=total, warmup=warmup, min_lr=min_lr,
                    tokens_per_step=tokens_per_step, baseline=baseline)
    finally:
        if board is not None:
            board.close()
        logger.close()


def _run(*, opts: TrainOptions, data: DataDir, out: Path, logger, budget: int | None, board,
         dtype_name: str, model, identity: dict, run_hash: str, ckpt, total: int, warmup: int,
         min_lr: float, tokens_per_step: int, baseline: int) -> int:
    import torch
    from .. import measure
    from ..api import fit
    from ..config import FitConfig
    from .checkpoint import latest_checkpoint, save_checkpoint
    from .codec import capture_rng, restore_rng
    from .data import Batches, eval_batches
    from .logger import eval_line, section, train_line
    from .schedule import lr_at

    # [Options]
    shown = opts.as_dict()
    shown.update({"steps": total, "warmup": warmup, "min_lr": min_lr, "dtype": dtype_name,
                  "out": str(out), "log": str(logger.path)})
    logger.print(section("Options", [(k.replace("_", "-"), "-" if v is None else v)
                                     for k, v in shown.items()]))
    logger.record("options", **shown)

    # [System]
    peak = peak_matmul_flops(dtype_name)
    system = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu_model(),
              "bf16 native": measure.fast_bf16(), "dtype": dtype_name,
              "peak matmul": f"{peak / 1e9:.1f} GFLOP/s ({dtype_name}, measured)"}
    logger.print()
    logger.print(section("System", list(system.items())))
    logger.record("system", **system, peak_matmul_flops=peak)

    # [Dataset]
    eval_tokens = len(data.eval) if data.eval is not None else 0
    dataset = [("train", f"{len(data.train):,} tokens ({data.path / 'train.bin'})"),
               ("eval", f"{eval_tokens:,} tokens" + (f" ({data.path / 'eval.bin'})" if data.eval
                                                     is not None else " (no eval.bin)")),
               ("vocab", f"{data.vocab_size:,} (model {model.config.vocab_size:,})"),
               ("seq len", opts.seq_len),
               ("tokens per step", f"{tokens_per_step:,} ({opts.batch_size} x {opts.grad_accum} x "
                                   f"{opts.seq_len})"),
               ("epochs", f"{total * tokens_per_step / len(data.train):.2f} over {total} steps")]
    logger.print()
    logger.print(section("Dataset", dataset))
    logger.record("dataset", train_tokens=len(data.train), eval_tokens=eval_tokens,
                  vocab_size=data.vocab_size, seq_len=opts.seq_len,
                  tokens_per_step=tokens_per_step, steps=total)

    # [Plan]
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if dtype_name == "bf16" \
        else contextlib.nullcontext
    params = list(model.parameters())
    param_bytes = sum(p.numel() * 4 for p in params if p.requires_grad)
    sample_batch = torch.zeros(opts.batch_size, opts.seq_len + 1, dtype=torch.long)
    sample = {"input_ids": sample_batch[:, :-1], "shift_labels": sample_batch[:, 1:]}
    with torch.random.fork_rng(devices=[]), autocast():
        module = fit(model, sample, ram=budget, reserve=2 * param_bytes,
                     config=FitConfig(planner=RECOMPUTE[opts.recompute], compile=opts.compile))
    plan = module.plan
    extra = plan.costs.extra
    grads = sum(p.nbytes for p in params if p.requires_grad)
    activations = max(0, plan.simulation.peak - grads)
    kinds = [("parameters", extra.get("parameters", 0)), ("gradients", grads),
             ("optimizer states (reserved)", extra.get("reserved", 0)),
             ("activations", activations), ("runtime", extra.get("runtime", 0))]
    rows = [(k, format_bytes(v)) for k, v in kinds]
    rows.append(("total (predicted peak)", format_bytes(plan.predicted_peak)))
    rows.append(("free", format_bytes(budget - plan.predicted_peak) + f" of the "
                 f"{format_bytes(budget)} budget" if budget else "- (no --ram budget)"))
    rows.append(("strategy", plan.strategy))
    rows.append(("predicted step", f"{plan.predicted_time * opts.grad_accum * 1e3:.0f} ms "
                                   f"({opts.grad_accum} x {plan.predicted_time * 1e3:.0f} ms "
                                   "forward+backward, optimizer not included)"))
    logger.print()
    logger.print(section("Plan", rows))
    logger.print(plan.explain())
    logger.record("plan", **{k: int(v) for k, v in kinds}, predicted_peak=int(plan.predicted_peak),
                  budget=budget, strategy=plan.strategy,
                  predicted_step_s=plan.predicted_time * opts.grad_accum)

    # optimizer: decay on matrices only
    decay = [p for p in params if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in params if p.requires_grad and p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": opts.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=opts.lr, betas=(0.9, 0.95), eps=1e-8)
    batches = Batches(data.train, opts.seq_len, opts.batch_size, opts.seed)
    start = 0
    if ckpt is not None:
        state = ckpt.trainer_state
        if ckpt.optimizer_state:
            optimizer.load_state_dict(ckpt.optimizer_state[0])
        batches.index = int(state["data"]["index"])
        restore_rng(state["rng"])
        start = ckpt.step
        logger.print(f"\nresumed from {ckpt.path} at step {start}")
        logger.record("resume", path=str(ckpt.path), step=start)
    else:
        torch.manual_seed(opts.seed)
    evals = []
    if opts.eval_every and data.eval is not None:
        evals = eval_batches(data.eval, opts.seq_len, opts.batch_size, opts.eval_steps)
        if not evals:
            logger.print(f"note: eval.bin holds {len(data.eval)} tokens, less than one window of "
                         f"{opts.seq_len + 1}: evaluation is off")

    flops_per_step = model_flops_per_token(model, opts.seq_len) * tokens_per_step

    def save(step: int) -> Path:
        path = save_checkpoint(out, step, model, tokenizer_file=data.tokenizer_file,
                               optimizer_state=[optimizer.state_dict()],
                               trainer_state={"step": step, "data": batches.state(),
                                              "rng": capture_rng(), "identity": identity,
                                              "config_hash": run_hash, "options": opts.as_dict(),
                                              "total_steps": total,
                                              "tokens": step * tokens_per_step})
        logger.record("checkpoint", step=step, path=str(path))
        return path

    def evaluate(step: int) -> None:
        t0 = time.perf_counter()
        model.eval()
        with torch.no_grad(), autocast():
            losses = [float(module(input_ids=b[:, :-1], shift_labels=b[:, 1:]).loss) for b in evals]
        model.train()
        loss = sum(losses) / len(losses)
        ms = (time.perf_counter() - t0) * 1e3
        ppl = math.exp(min(loss, 700.0))
        logger.print(eval_line(step=step, loss=loss, ppl=ppl, ms=ms))
        logger.record("eval", step=step, loss=loss, ppl=ppl, ms=ms, tokens=step * tokens_per_step)
        if board is not None:
            board.scalars(step, {"eval/loss": loss})

    if start >= total:
        logger.print(f"\nthe checkpoint is at step {start}, the run has {total} steps: nothing "
                     "to do (raise --steps to train further)")
        return 0
    logger.print()
    last_saved = start if ckpt is not None else None
    step = start
    step_s = 0.0
    with _Interrupt() as interrupt:
        for step in range(start + 1, total + 1):
            t0 = time.perf_counter()
            lr = lr_at(step - 1, lr=opts.lr, warmup=warmup, total=total, min_lr=min_lr)
            for group in optimizer.param_groups:
                group["lr"] = lr
            micro = []
            for _ in range(opts.grad_accum):
                batch = batches.next()
                with autocast():
                    loss = module(input_ids=batch[:, :-1], shift_labels=batch[:, 1:]).loss
                (loss / opts.grad_accum).backward()
                micro.append(loss.detach().float())
            loss_value = float(torch.stack(micro).mean())
            norm = torch.nn.utils.clip_grad_norm_(params, opts.clip if opts.clip > 0 else math.inf)
            norm_value = float(norm)
            if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
                what = (f"loss is {loss_value}" if not math.isfinite(loss_value)
                        else f"gradient norm is {norm_value}")
                logger.record("error", step=step, loss=loss_value, norm=norm_value)
                good = latest_checkpoint(out)
                raise TierflowError(f"the {what} at step {step}: training stopped, nothing saved "
                                    f"for this step; the last good checkpoint is "
                                    f"{good if good else 'none (no checkpoint was written)'}; fix: "
                                    "lower --lr, raise --warmup or set --clip")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step_s = time.perf_counter() - t0
            ram = max(0, measure.maxrss_bytes() - baseline)
            sol = flops_per_step / (step_s * peak) if peak > 0 else None
            tok_s = tokens_per_step / step_s
            logger.print(train_line(step=step, total=total, ms=step_s * 1e3, norm=norm_value,
                                    loss=loss_value, tok_s=tok_s, sol=sol, ram_bytes=ram,
                                    budget=budget))
            logger.record("train", step=step, total=total, loss=loss_value, norm=norm_value, lr=lr,
                          ms=step_s * 1e3, tok_s=tok_s, sol=sol, ram_bytes=ram, budget=budget,
                          tokens=step * tokens_per_step)
            if board is not None:
                board.scalars(step, {"train/loss": loss_value, "train/grad_norm": norm_value,
                                     "train/lr": lr, "train/tok_s": tok_s,
                                     "memory/ram_bytes": ram})
            if evals and opts.eval_every and step % opts.eval_every == 0:
                evaluate(step)
            if opts.save_every and step % opts.save_every == 0 and step != total:
                save(step)
                last_saved = step
            if interrupt.requested and step != total:
                path = save(step)
                logger.print(f"interrupted: saved step {step} to {path}; continue with "
                             f"--resume {path}")
                logger.record("interrupted", step=step, path=str(path))
                return INTERRUPTED
            logger.bar(step, total, step_s)
    if evals and opts.eval_every and total % opts.eval_every != 0:
        evaluate(total)
    path = save(total) if last_saved != total else out / f"step_{total}"
    logger.print(f"done: {total} steps; saved {path}")
    logger.record("done", step=total, path=str(path))
    return 0
