"""``--lora RANK``: LoRA adapters on a built model, injected by peft itself.

``peft.get_peft_model`` replaces each target module of the model, in place, by peft's LoRA
layer: the original module becomes its ``base_layer`` (its weight frozen) and beside it
``lora_A`` (rank x in, peft's Kaiming init) and ``lora_B`` (out x rank, zeros) add
``lora_B(lora_A(dropout(x))) * alpha / rank`` to its output. peft freezes every other
parameter of the model. The model object keeps its structure (the decoder layers in their
``nn.ModuleList``, the embeddings, final norm and head where they were), so the chain
(``chain/hf*.py``) finds its parts as in the plain model and each layer's adapters are
parameters of that layer's stage: they train, the base weights are read only. The
``PeftModel`` around it is kept for what only peft knows: the names and config an adapter
directory holds, so that ``PeftModel.from_pretrained(base, dir)`` loads it as it is.

The targets default to peft's ``all-linear``: every ``nn.Linear`` (and GPT-2's ``Conv1D``)
but the output layer, i.e. the attention and MLP projections of each decoder layer, in any
family. peft's init of ``lora_A`` draws random numbers: from torch's generator seeded with
the run's seed inside ``fork_rng``, so the adapters are the same in every run of a seed and
the run's own random stream is untouched.

No torch or peft is imported until a model is adapted: the command line checks the flags
(``split_targets``) before it imports torch.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.errors import TierflowError

if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel
    from torch import nn

ALL_LINEAR = "all-linear"  # peft's shorthand: every linear layer but the output layer


def split_targets(value: str | None) -> tuple[str, ...] | str:
    """The module names ``--lora-targets`` gives (comma-separated), or ``ALL_LINEAR`` when
    it is not given (or says so); one line if a name is empty."""
    if value is None or value.strip().lower() == ALL_LINEAR:
        return ALL_LINEAR
    give = "give comma-separated module names, e.g. 'q_proj,v_proj', or all-linear"
    if not isinstance(value, str):
        raise TierflowError(f"--lora-targets {value!r} is not text: {give}")
    names = tuple(n.strip() for n in value.split(","))
    if not all(names):
        raise TierflowError(f"--lora-targets {value!r} has an empty name: {give}")
    return names


@dataclass(frozen=True)
class LoraSpec:
    """The adapters of a run: ``rank``, ``alpha`` (their scale is alpha / rank), ``dropout``
    on their input and the ``targets`` (module names or ``ALL_LINEAR``)."""
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...] | str

    def identity(self) -> dict[str, Any]:
        """What decides a run's losses, for its identity (``train/model.run_identity``)."""
        targets = self.targets if isinstance(self.targets, str) else list(self.targets)
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout,
                "targets": targets}

    def config(self) -> LoraConfig:
        """peft's ``LoraConfig`` of these adapters, for a causal LM."""
        from peft import LoraConfig, TaskType
        targets = self.targets if isinstance(self.targets, str) else list(self.targets)
        return LoraConfig(task_type=TaskType.CAUSAL_LM, r=self.rank, lora_alpha=self.alpha,
                          lora_dropout=self.dropout, target_modules=targets, bias="none")


def add_adapters(model: nn.Module, spec: LoraSpec, seed: int) -> PeftModel:
    """Inject ``spec``'s adapters into ``model`` in place (peft's ``get_peft_model``),
    their init drawn from ``seed``; every other parameter frozen. Returns the ``PeftModel``
    that wraps ``model``. A target that names no module of the model is one line."""
    import torch
    from peft import get_peft_model

    check_targets(model, spec.targets)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # transformers' deprecation of a name peft still calls: not the user's to fix
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                category=FutureWarning)
        torch.manual_seed(seed)
        try:
            return get_peft_model(model, spec.config())
        except ValueError as e:  # a target peft cannot adapt (a norm, an activation)
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise TierflowError(f"--lora-targets {','.join(spec.targets)!r} cannot take LoRA "
                                f"adapters ({first}); fix: name linear layers such as "
                                f"{', '.join(_linear_names(model)[:6])}") from None


def check_targets(model: nn.Module, targets: tuple[str, ...] | str) -> None:
    """Each target must name a module of ``model`` (its name or the end of it, as peft
    matches them): one line naming the first that does not, and the linear layers there
    are."""
    if isinstance(targets, str):
        return
    names = [name for name, _ in model.named_modules()]
    for target in targets:
        if not any(n == target or n.endswith("." + target) for n in names):
            known = _linear_names(model)
            raise TierflowError(f"--lora-targets {target!r} names no module of this "
                                f"{type(model).__name__}: its linear layers are "
                                f"{', '.join(known)}; fix: give some of them, or leave "
                                "--lora-targets out (all-linear)")


def _linear_names(model: nn.Module) -> list[str]:
    """The last part of the names of ``model``'s linear layers, once each, in order."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D
    seen: dict[str, None] = {}
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, Conv1D)):
            seen.setdefault(name.rsplit(".", 1)[-1], None)
    return list(seen)
