"""The options of ``tierflow train``: a typed dataclass and its checks (the flags and the TOML
file that fill it: ``cli/train.py``).

Every flag can also come from a TOML file (``--config FILE``): keys are the option names
with ``-`` or ``_`` (``seq-len = 512`` or ``seq_len = 512``). Flags given on the command line
win over the file, the file over the defaults. ``TrainOptions.validate`` checks every value
whatever its source, so a bad value in the file is the same one-line error as a bad flag.

Precision (``tierflow.precision``): ``--model-dtype``, ``--master``, ``--optim-dtype``,
``--matmul-dtype`` and ``--fp8-grad`` map one to one onto ``PrecisionConfig``. ``--dtype``
is the older name of the matmul choice and keeps working: ``--dtype bf16`` is
``--matmul-dtype bf16``, ``--dtype fp32`` is ``--matmul-dtype fp32``, and without either
the matmuls are bf16 where the CPU computes bf16 natively (or the weights are bf16), else
fp32. Both flags given must agree (``--dtype bf16 --matmul-dtype fp8`` does: fp8 Linears
inside bf16 autocast); ``TrainOptions.precision()`` resolves them.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from ..core.config import DEFAULT_CLIP
from ..core.errors import TierflowError
from ..core.units import parse_bytes
from ..exec.enforce import check_flags as check_enforce_flags
from ..models.freeze import split_patterns
from ..precision.config import CHOICES
from .roles import fit_owns_optimizer, ranks_hold_replicas

if TYPE_CHECKING:
    from ..precision import PrecisionConfig

STREAM = ("auto", "all")
HOST_UPDATES = ("auto", "never", "all")
OPTIMIZER_STATES = ("auto", "compute", "ram", "disk")  # FitConfig's STATES_TIERS
RECOMPUTE = {"auto": "auto", "none": "keep-all", "all": "checkpoint-all"}
DTYPES = ("auto", "fp32", "bf16")


@dataclass
class TrainOptions:
    model: str | None = None  # a preset name or a local Hugging Face directory
    data: str | None = None  # a directory written by tierflow tokenize
    ram: str | None = None  # RAM budget, e.g. "4GiB"; None: no budget
    gpu: str | None = None  # GPU budget: train on CUDA with host RAM (--ram) below
    simulate_gpu: bool = False  # with --gpu: plan and run the CPU as a GPU of that size
    disk: str | None = None  # the disk tier's directory; None (or "none"): no disk tier
    stream: str = "auto"  # with --disk: stream the weights that must (auto) or all of them
    prefetch: int | None = None  # with --disk: stages read ahead (0: on demand); None: planned
    serial_reads: bool = False  # with --disk: the plan's reads on demand (the overlap ablation)
    enforce: bool = False  # with --ram: a memory cgroup holds the process to it
    unenforced_ok: bool = False  # with --enforce: where no cgroup can be made, run on anyway
    host_updates: str = "auto"  # fit's AdamW under --gpu: steps in host RAM (auto/never/all)
    optimizer_states: str = "auto"  # fit's AdamW: the tier of its states (or the planner's)
    seq_len: int = 256
    batch_size: int = 4
    grad_accum: int = 1
    steps: int | None = None  # optimizer steps; default from --epochs, else 100
    epochs: float | None = None
    lr: float = 3e-4
    warmup: int | None = None  # default: 5% of the steps
    min_lr: float | None = None  # default: lr / 10
    weight_decay: float = 0.1
    clip: float = DEFAULT_CLIP  # 0 disables clipping
    seed: int = 0
    eval_every: int = 100  # 0 disables evaluation
    eval_steps: int = 10
    save_every: int = 0  # 0: save only at the end and on Ctrl-C
    out: str | None = None  # default ./out, or the checkpoint's run directory with --resume
    resume: str | None = None
    log: str | None = None  # default OUT/log.jsonl
    dtype: str = "auto"  # auto: bf16 autocast where the CPU has native bf16, else fp32
    model_dtype: str = "fp32"  # weight (and gradient) storage
    master: str = "fp32"  # fp32 master copy of bf16 weights, or none (stochastic rounding)
    optim_dtype: str = "fp32"  # AdamW moments: fp32, bf16 or blockwise int8
    matmul_dtype: str | None = None  # fp32, bf16 or fp8; None: from --dtype
    fp8_grad: str = "bf16"  # the gradient matmuls of fp8 Linears: bf16 or e5m2
    compile: bool = False
    recompute: str = "auto"
    freeze: str | None = None  # comma-separated parameter-name globs to freeze (freeze.py)
    train_only: str | None = None  # comma-separated globs: every other parameter is frozen
    lora: int | None = None  # LoRA adapters of this rank on a frozen base (models/lora.py)
    lora_alpha: float | None = None  # the adapters' scale is alpha / rank; default: the rank
    lora_dropout: float = 0.0  # dropout on the adapters' input
    lora_targets: str | None = None  # comma-separated module names; default all-linear
    merge: bool = False  # with --lora: also write the base with the adapters merged in
    tensorboard: str | None = None  # a directory for TensorBoard event files
    trace: str | None = None  # a Chrome-trace JSON file of the executed steps
    dist_timeout: float = 300.0  # seconds a rank waits for the others (torchrun runs)
    allow_other_tokenizer: bool = False  # train on data tokenized with another tokenizer
    config: str | None = None
    # the options given by a flag or the config file (the rest may come from a checkpoint)
    given: frozenset = field(default=frozenset(), repr=False, compare=False)

    def validate(self, world_size: int = 1) -> "TrainOptions":
        """Check every value; ``world_size`` ranks (torchrun) split each global batch."""
        self.check_flags(world_size)
        self._check_precision_support()
        return self

    def check_flags(self, world_size: int = 1) -> "TrainOptions":
        """Every check of ``validate`` but the precision's contradictions and what this torch
        and CPU can run (``PrecisionConfig.validate``, which needs torch): the command line
        makes these before importing torch, so a bad flag is one line at once."""
        if not self.model and not self.resume:
            raise TierflowError("--model is missing: give a preset name (e.g. llama-20m) or a "
                                "directory with config.json and model.safetensors")
        if not self.data and not self.resume:
            raise TierflowError("--data is missing: give a directory written by "
                                "'tierflow tokenize' (train.bin, eval.bin, tokenizer.json)")
        if self.disk == "none":  # resuming a run that had a disk tier without one
            self.disk = None
        for name in ("seq_len", "batch_size", "grad_accum", "steps", "eval_steps"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("warmup", "seed", "eval_every", "save_every", "prefetch"):
            _check_int(name, getattr(self, name), minimum=0)
        for name in ("lr", "min_lr", "weight_decay", "clip", "epochs", "dist_timeout"):
            _check_float(name, getattr(self, name),
                         positive=name in ("lr", "epochs", "dist_timeout"))
        if self.batch_size % world_size:
            raise TierflowError(f"--batch-size {self.batch_size} is not divisible by the "
                                f"{world_size} ranks: give a multiple of {world_size} (it is "
                                "the global batch; each rank takes batch-size / ranks rows)")
        if self.steps is not None and self.epochs is not None:
            raise TierflowError("--steps and --epochs were both given: give one of them")
        if self.min_lr is not None and self.min_lr > self.lr:
            raise TierflowError(f"--min-lr {self.min_lr} is above --lr {self.lr}: give a "
                                "--min-lr at most --lr")
        if self.dtype not in DTYPES:
            raise TierflowError(f"--dtype {self.dtype!r} is unknown: use fp32, bf16 or auto")
        self._check_precision_flags(world_size)
        if self.stream not in STREAM:
            raise TierflowError(f"--stream {self.stream!r} is unknown: use auto or all")
        if self.disk is None and self.stream != "auto":
            raise TierflowError(f"--stream {self.stream} streams weights from the disk tier: "
                                "give --disk DIR too")
        if self.recompute not in RECOMPUTE:
            raise TierflowError(f"--recompute {self.recompute!r} is unknown: use auto, none "
                                "or all")
        if self.ram is not None:
            parse_bytes(self.ram, what="--ram")
        self._validate_gpu(world_size)
        self._require_bool("serial_reads")
        self._require_bool("enforce")
        self._require_bool("unenforced_ok")
        check_enforce_flags(self.enforce, self.unenforced_ok, self.ram, self.gpu)
        if self.serial_reads and self.disk is None:
            raise TierflowError("--serial-reads runs the disk tier's reads on demand: give "
                                "--disk DIR too")
        if self.host_updates not in HOST_UPDATES:
            raise TierflowError(f"--host-updates {self.host_updates!r} is unknown: use "
                                f"{', '.join(HOST_UPDATES)}")
        if self.host_updates != "auto" and self.gpu is None:
            raise TierflowError(f"--host-updates {self.host_updates} chooses where tierflow's "
                                "own AdamW steps the stages whose states live in the host RAM "
                                "below a GPU: give --gpu too")
        if self.optimizer_states not in OPTIMIZER_STATES:
            raise TierflowError(f"--optimizer-states {self.optimizer_states!r} is unknown: use "
                                f"{', '.join(OPTIMIZER_STATES)}")
        if self.optimizer_states != "auto" and not fit_owns_optimizer(self):
            raise TierflowError(f"--optimizer-states {self.optimizer_states} places the states "
                                "of tierflow's own AdamW (that of a run with a disk tier or a "
                                "GPU) among its tiers: give --disk DIR or --gpu too")
        if self.optimizer_states == "compute" and self.stream == "all":
            raise TierflowError("--optimizer-states compute keeps AdamW's states on the "
                                "compute tier, but --stream all keeps them below it, beside "
                                "the streamed weights: give --stream auto, or another tier")
        if self.optimizer_states == "ram" and self.gpu is None:
            raise TierflowError("--optimizer-states ram keeps AdamW's states in the host RAM "
                                "below a GPU: give --gpu too (without it RAM is the compute "
                                "tier: compute)")
        self._require_bool("compile")
        for name in ("freeze", "train_only"):
            split_patterns(flag_of(name), getattr(self, name))
        self._check_lora()
        return self

    def _check_lora(self) -> None:
        """``--lora RANK`` and its options (``models/lora.py``); a target that names no module
        of the model is refused once the model's structure is known."""
        from ..models.lora import split_targets
        self._require_bool("merge")
        if self.lora is None:
            given = [flag_of(n) for n in ("lora_alpha", "lora_targets") if getattr(self, n)
                     is not None] + (["--lora-dropout"] if self.lora_dropout else []) + \
                (["--merge"] if self.merge else [])
            if given:
                raise TierflowError(f"{given[0]} sets up LoRA adapters: give --lora RANK too "
                                    "(e.g. --lora 16)")
            return
        if isinstance(self.lora, bool) or not isinstance(self.lora, int) or self.lora < 1:
            raise TierflowError(f"--lora {self.lora!r} is not a rank: give a whole number of "
                                "at least 1, e.g. --lora 16")
        _check_float("lora_alpha", self.lora_alpha, positive=True)
        _check_float("lora_dropout", self.lora_dropout, positive=False)
        if self.lora_dropout >= 1:
            raise TierflowError(f"--lora-dropout {self.lora_dropout} must be below 1: give a "
                                "probability such as 0.05 (0: none)")
        split_targets(self.lora_targets)
        import importlib.util
        if importlib.util.find_spec("peft") is None:
            raise TierflowError("--lora injects peft's adapters, and peft is not installed: "
                                "pip install 'tierflow[lora]' (or peft)")
        for name in ("freeze", "train_only"):
            if getattr(self, name) is not None:
                raise TierflowError(f"--lora trains its adapters and freezes every weight of "
                                    f"the model: drop {flag_of(name)}")

    def _require_bool(self, name: str) -> None:
        """A flag's value from a config file must be true or false (argparse gives bools)."""
        value = getattr(self, name)
        if not isinstance(value, bool):
            raise TierflowError(f"{name} = {value!r} in the config file is not a boolean: use "
                                "true or false")

    def _validate_gpu(self, world_size: int) -> None:
        self._require_bool("simulate_gpu")
        if self.gpu is None:
            if self.simulate_gpu:
                raise TierflowError("--simulate-gpu needs --gpu SIZE: the budget of the GPU to "
                                    "simulate")
            return
        parse_bytes(self.gpu, what="--gpu")
        if world_size > 1:
            raise TierflowError(f"--gpu {self.gpu} under torchrun ({world_size} ranks) is not "
                                "built yet: train the ranks on the CPU with --ram, or run one "
                                "process")

    def _check_precision_flags(self, world_size: int) -> None:
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            if value not in choices and not (name == "matmul_dtype" and value is None):
                raise TierflowError(f"{flag_of(name)} {value!r} is unknown: use "
                                    f"{', '.join(choices[:-1])} or {choices[-1]}")
        matmul = self.matmul_dtype
        if matmul is not None and self.dtype != "auto" and (self.dtype == "fp32") != (
                matmul == "fp32"):
            raise TierflowError(f"--dtype {self.dtype} and --matmul-dtype {matmul} disagree "
                                f"(--dtype is the older name of --matmul-dtype): give only "
                                f"--matmul-dtype {matmul}")
        rounding = self.optim_dtype != "fp32" or (self.model_dtype == "bf16"
                                                 and self.master == "none")
        if world_size > 1 and rounding and not ranks_hold_replicas(self):
            # ZeRO-2 shards: the states of a rank are a slice of each stage's
            raise TierflowError(f"--optim-dtype {self.optim_dtype} with --model-dtype "
                                f"{self.model_dtype} --master {self.master} cannot run on "
                                f"{world_size} ranks: ZeRO sharding needs element-wise optimizer "
                                "states without a random stream (no int8 blocks, no stochastic "
                                "rounding); use --optim-dtype fp32 and --master fp32, --disk "
                                "(replicas, not shards), or one process")

    def _check_precision_support(self) -> None:
        """The precision's contradictions and what this torch and CPU cannot run (imports
        torch)."""
        from ..precision import PrecisionError, check_device
        from ..profile.machine import fast_bf16
        try:
            check_device(self.precision(fast_bf16()), "cpu")
        except PrecisionError as e:  # the same line, in flags: --master none, not master='none'
            flags = re.sub(r"\b(model_dtype|master|optim_dtype|matmul_dtype|fp8_grad)='(\w+)'",
                           lambda m: f"{flag_of(m[1])} {m[2]}", str(e))
            raise TierflowError(flags) from None

    def precision(self, native_bf16: bool) -> PrecisionConfig:
        """The ``tierflow.precision.PrecisionConfig`` of these options; ``native_bf16``
        (whether the CPU computes bf16 natively) decides the matmuls when neither
        ``--matmul-dtype`` nor ``--dtype`` does (see the module docstring)."""
        from ..precision import PrecisionConfig
        matmul = self.matmul_dtype
        if matmul is None and self.dtype != "auto":
            matmul = self.dtype
        if matmul is None:
            matmul = "bf16" if native_bf16 or self.model_dtype == "bf16" else "fp32"
        return PrecisionConfig(model_dtype=self.model_dtype, master=self.master,
                               optim_dtype=self.optim_dtype, matmul_dtype=matmul,
                               fp8_grad=self.fp8_grad)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        del data["given"]
        return data

    def inherit(self, saved: dict[str, Any]) -> None:
        """With --resume: the options of the checkpoint's run for those not given now
        (--out, --log, --resume, --config and --trace are never inherited; nor are --stream,
        --prefetch, --serial-reads, --host-updates and --optimizer-states when --disk is
        given, ``--disk none``
        included)."""
        never = {"given", "out", "log", "resume", "config", "trace"}
        if "disk" in self.given:
            never |= {"stream", "prefetch", "serial_reads", "host_updates", "optimizer_states"}
        for f in fields(self):
            if f.name in saved and f.name not in self.given and f.name not in never:
                setattr(self, f.name, saved[f.name])


def flag_of(name: str) -> str:
    """The command-line flag of option ``name`` (``seq_len``: ``--seq-len``)."""
    return "--" + name.replace("_", "-")


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TierflowError(f"{flag_of(name)} {value!r} is not a whole number: give e.g. "
                            f"{flag_of(name)} {max(minimum, 1)}")
    if value < minimum:
        raise TierflowError(f"{flag_of(name)} {value} must be at least {minimum}")


def _check_float(name: str, value: Any, *, positive: bool) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
            or value in (float("inf"), float("-inf")):
        raise TierflowError(f"{flag_of(name)} {value!r} is not a finite number")
    if value < 0 or (positive and value == 0):
        bound = "positive" if positive else "at least 0"
        raise TierflowError(f"{flag_of(name)} {value} must be {bound}"
                            f"{', e.g. 3e-4' if name == 'lr' else ''}")
