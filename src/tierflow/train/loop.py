"""``tierflow train``: the training loop around ``tierflow.fit``.

One run: check the options, the data and the output directory (cheap, before anything slow);
build or load the model; plan the step with ``tierflow.fit`` (gradients accumulate in
``.grad``, the AdamW state is ``reserve``d in the plan); then per optimizer step:
``grad_accum`` micro-batches forward and backward, global-norm clipping, AdamW with the
warmup + cosine schedule, one ``[T]`` line and one JSON record. ``[V]`` evaluations every
``--eval-every`` steps; checkpoints every ``--save-every`` steps, at the end and on Ctrl-C.

Resuming restores the weights, the AdamW state, the data stream position and every RNG, so
the resumed steps are bit-identical (fp32) to an uninterrupted run's.

Under ``torchrun`` (``WORLD_SIZE`` > 1) every rank runs this loop on its rows of each global
batch (``tierflow.dist``): gradients are reduce-scattered stage by stage during backward,
the optimizer updates this rank's shard (ZeRO-2) and the parameters are all-gathered; rank 0
prints, logs and writes checkpoints in the single-process format. The optimizer is built in
``make_optimizer`` alone, for one process and for the shards alike.
"""
from __future__ import annotations

import contextlib
import math
import signal
import time
from pathlib import Path
from typing import Any

from ..errors import TierflowError
from ..paths import require_writable_dir
from ..units import parse_bytes
from .data import DataDir, open_data
from .options import RECOMPUTE, TrainOptions
from .sol import cpu_model, model_flops_per_token, peak_matmul_flops

INTERRUPTED = 130
DEFAULT_STEPS = 100


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
    """Run ``tierflow train`` with validated ``opts``; returns the exit code. Under torchrun
    (``WORLD_SIZE`` > 1) every rank runs this, in the default process group."""
    try:
        return _train(opts)
    except PermissionError as e:  # a file or directory the user may not read or write
        name = e.filename or "a file"
        raise TierflowError(f"cannot read {name} (permission denied): check its permissions "
                            "or copy it somewhere you can read") from None


def _train(opts: TrainOptions) -> int:
    import torch  # noqa: F401  (part of the RSS baseline)
    from transformers import AutoModelForCausalLM  # noqa: F401  (part of the RSS baseline)

    from .. import api, measure  # noqa: F401
    from ..dist import join_from_env, world_size_from_env
    from .checkpoint import load_checkpoint

    baseline = measure.maxrss_bytes()

    # --- everything cheap first: resume state, data, output directory
    ckpt = load_checkpoint(opts.resume) if opts.resume else None
    if ckpt is not None:
        saved_opts = ckpt.trainer_state.get("options")
        if isinstance(saved_opts, dict):
            opts.inherit(saved_opts)
    opts.validate(world_size_from_env())
    data = open_data(opts.data)
    out = Path(opts.out) if opts.out else (ckpt.path.parent if ckpt is not None else Path("out"))
    opts.out = str(out)
    require_writable_dir(out, "--out")
    if opts.tensorboard:
        require_writable_dir(opts.tensorboard, "--tensorboard")
    log_path = Path(opts.log) if opts.log else out / "log.jsonl"
    budget = parse_bytes(opts.ram, what="--ram") if opts.ram else None
    dtype_name = opts.dtype if opts.dtype != "auto" else ("bf16" if measure.fast_bf16() else "fp32")

    world = join_from_env(opts.dist_timeout)
    if world is None:
        return _train_in_world(opts, ckpt, data, out, log_path, budget, dtype_name, None,
                               baseline)
    try:
        code = _train_in_world(opts, ckpt, data, out, log_path, budget, dtype_name, world,
                               baseline)
    except BaseException:
        world.close(finished=False)
        raise
    world.close(finished=True)
    return code


def _train_in_world(opts: TrainOptions, ckpt, data: DataDir, out: Path, log_path: Path,
                    budget: int | None, dtype_name: str, world, baseline: int) -> int:
    """Build or load the model, check the run's identity, then ``_run`` (every rank)."""
    import torch

    from ..models.load import load_model
    from ..models.presets import PRESETS
    from .codec import config_hash, differences, model_arch, spec_arch
    from .logger import Logger

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

    arch = model_arch(model)
    if ckpt is not None and "model" in opts.given:  # the checkpoint's weights, the given model
        arch = spec_arch(spec, data.vocab_size)
    identity = {"model": arch, "data": data.identity(), "seq_len": opts.seq_len,
                "batch_size": opts.batch_size, "grad_accum": opts.grad_accum, "seed": opts.seed}
    run_hash = config_hash(identity)
    if ckpt is not None:
        saved = ckpt.trainer_state.get("identity")
        if ckpt.trainer_state.get("config_hash") != run_hash:
            diffs = differences(saved, identity) if isinstance(saved, dict) else ["unknown run"]
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

    main = world is None or world.is_main
    logger = Logger(log_path, append=ckpt is not None, active=main)
    board = None
    try:
        if opts.tensorboard and main:
            from .tensorboard import EventWriter
            board = EventWriter(opts.tensorboard)
        return _run(opts=opts, data=data, out=out, logger=logger, budget=budget, board=board,
                    dtype_name=dtype_name, model=model, identity=identity, run_hash=run_hash,
                    ckpt=ckpt, total=total, warmup=warmup, min_lr=min_lr,
                    tokens_per_step=tokens_per_step, baseline=baseline, world=world)
    finally:
        if board is not None:
            board.close()
        logger.close()


def _run(*, opts: TrainOptions, data: DataDir, out: Path, logger, budget: int | None, board,
         dtype_name: str, model, identity: dict, run_hash: str, ckpt, total: int, warmup: int,
         min_lr: float, tokens_per_step: int, baseline: int, world) -> int:
    import torch

    from .. import measure
    from ..api import fit
    from ..config import FitConfig
    from ..dist import ShardedOptimizer, bus_bandwidth, step_seconds
    from .checkpoint import latest_checkpoint, save_checkpoint
    from .codec import capture_rng, restore_rng
    from .data import Batches, eval_batches
    from .logger import eval_line, plan_section, section, train_line
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
    if world is not None:
        system["ranks"] = f"{world.size} ({world.backend}); this machine's figures are rank 0's"
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

    # [Plan]: per rank (budgets are per rank; each rank runs batch-size / ranks rows)
    ranks = world.size if world is not None else 1
    main = world is None or world.is_main
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if dtype_name == "bf16" \
        else contextlib.nullcontext
    params = list(model.parameters())
    param_bytes = sum(p.numel() * 4 for p in params if p.requires_grad)
    moments = 2 * -(-param_bytes // ranks)  # AdamW's two fp32 moments, this rank's shard
    sample_batch = torch.zeros(opts.batch_size // ranks, opts.seq_len + 1, dtype=torch.long)
    sample = {"input_ids": sample_batch[:, :-1], "shift_labels": sample_batch[:, 1:]}
    with torch.random.fork_rng(devices=[]), autocast():
        module = fit(model, sample, ram=budget, reserve=moments,
                     config=FitConfig(planner=RECOMPUTE[opts.recompute], compile=opts.compile))
    grads = sum(p.nbytes for p in params if p.requires_grad)
    dist_figures = None
    if world is not None:
        bus = bus_bandwidth(world, torch.device("cpu"))
        dist_figures = {"world_size": ranks, "backend": world.backend, "bus_bandwidth": bus,
                        "comm_bytes": grads + param_bytes,
                        "predicted_comm_s": step_seconds(ranks, grads, param_bytes, bus)}
    table, fields = plan_section(module.plan, grads=grads, budget=budget,
                                 grad_accum=opts.grad_accum, dist=dist_figures)
    logger.print()
    logger.print(table)
    logger.print(module.plan.explain())
    logger.record("plan", **fields)

    groups = param_groups(params, opts)
    if world is None:
        optimizer: Any = _Local(make_optimizer(groups, opts), params)
    else:
        optimizer = ShardedOptimizer(world, [list(stage.parameters())
                                             for stage in module.chain.stages],
                                     groups, lambda shard: make_optimizer(shard, opts))
    batches = Batches(data.train, opts.seq_len, opts.batch_size, opts.seed,
                      part=(world.rank, ranks) if world is not None else (0, 1))
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
        optimizer_state = optimizer.state_dict()  # gathered on rank 0 (every rank calls it)
        if not main:
            return out / f"step_{step}"
        path = save_checkpoint(out, step, model, tokenizer_file=data.tokenizer_file,
                               optimizer_state=[optimizer_state],
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
        mine = evals if world is None else evals[world.rank::ranks]  # whole batches per rank
        with torch.no_grad(), autocast():
            losses = [float(module(input_ids=b[:, :-1], shift_labels=b[:, 1:]).loss) for b in mine]
        model.train()
        total_loss, count = sum(losses), len(losses)
        if world is not None:
            per_rank = world.all_gather([total_loss, count], "evaluation loss average")
            total_loss, count = sum(r[0] for r in per_rank), sum(r[1] for r in per_rank)
        loss = total_loss / count
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
            if world is not None:
                world.step = step
            lr = lr_at(step - 1, lr=opts.lr, warmup=warmup, total=total, min_lr=min_lr)
            for group in optimizer.param_groups:
                group["lr"] = lr
            micro = []
            for k in range(opts.grad_accum):
                optimizer.micro_batch(last=k == opts.grad_accum - 1)
                batch = batches.next()
                with autocast():
                    loss = module(input_ids=batch[:, :-1], shift_labels=batch[:, 1:]).loss
                (loss / opts.grad_accum).backward()
                micro.append(loss.detach().float())
            loss_value = float(torch.stack(micro).mean())
            if world is not None:  # the ranks' means of equal row counts: the global mean
                means = world.all_gather([loss_value], "loss average")
                loss_value = sum(r[0] for r in means) / ranks
            norm_value = optimizer.clip_grad_norm(opts.clip if opts.clip > 0 else math.inf)
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
            step_s = time.perf_counter() - t0
            ram = max(0, measure.maxrss_bytes() - baseline)
            per_rank = [[ram, optimizer.state_bytes(), interrupt.requested]]
            if world is not None:
                per_rank = world.all_gather(per_rank[0], "memory report")
            ram_ranks = [int(r[0]) for r in per_rank]
            stop = any(r[2] for r in per_rank)  # every rank saves, or none
            sol = flops_per_step / (step_s * peak * ranks) if peak > 0 else None
            tok_s = tokens_per_step / step_s
            logger.print(train_line(step=step, total=total, ms=step_s * 1e3, norm=norm_value,
                                    loss=loss_value, tok_s=tok_s, sol=sol,
                                    ram_bytes=max(ram_ranks), budget=budget))
            logger.record("train", step=step, total=total, loss=loss_value, norm=norm_value, lr=lr,
                          ms=step_s * 1e3, tok_s=tok_s, sol=sol, ram_bytes=max(ram_ranks),
                          ram_bytes_per_rank=ram_ranks, budget=budget,
                          optimizer_state_bytes_per_rank=[int(r[1]) for r in per_rank],
                          tokens=step * tokens_per_step)
            if board is not None:
                board.scalars(step, {"train/loss": loss_value, "train/grad_norm": norm_value,
                                     "train/lr": lr, "train/tok_s": tok_s,
                                     "memory/ram_bytes": max(ram_ranks)})
            if evals and opts.eval_every and step % opts.eval_every == 0:
                evaluate(step)
            if opts.save_every and step % opts.save_every == 0 and step != total:
                save(step)
                last_saved = step
            if stop and step != total:
                path = save(step)
                logger.print(f"interrupted: saved step {step} to {path}; continue with "
                             f"--resume {path}")
                logger.record("interrupted", step=step, path=str(path))
                return INTERRUPTED
            logger.bar(step, total, step_s)
    if evals and opts.eval_every and total % opts.eval_every != 0:
        evaluate(total)
    path = save(total) if last_saved != total else out / f"step_{total}"
    if world is not None:
        world.barrier("end of the run")  # rank 0 has written the last checkpoint
    logger.print(f"done: {total} steps; saved {path}")
    logger.record("done", step=total, path=str(path))
    return 0


# ---------------------------------------------------------------- the optimizer

def param_groups(params: list, opts: TrainOptions) -> list[dict[str, Any]]:
    """AdamW's param groups: weight decay on matrices only."""
    decay = [p for p in params if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in params if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": opts.weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(groups: list[dict[str, Any]], opts: TrainOptions):
    """The one place the optimizer is built. Under torchrun the same call builds it over this
    rank's shards of the parameters (``ShardedOptimizer``), so any element-wise optimizer
    can take AdamW's place here."""
    import torch
    return torch.optim.AdamW(groups, lr=opts.lr, betas=(0.9, 0.95), eps=1e-8)


class _Local:
    """The single process: the optimizer over the full parameters and torch's global-norm
    clipping, with the interface of ``tierflow.dist.ShardedOptimizer``."""

    def __init__(self, optimizer, params: list) -> None:
        self.optimizer = optimizer
        self.params = params

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups  # load_state_dict replaces the list

    def micro_batch(self, last: bool) -> None:
        """Nothing to synchronise in one process."""

    def clip_grad_norm(self, max_norm: float) -> float:
        import torch
        return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        return sum(t.nbytes for state in self.optimizer.state.values() for t in state.values()
                   if hasattr(t, "nbytes"))

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
