"""Where ``tierflow train`` computes: the CPU under ``--ram``, a CUDA GPU under ``--gpu`` (host
RAM below it, budgeted by ``--ram``), or the CPU planned and run as a GPU of ``--gpu`` bytes
(``--simulate-gpu``: the three-tier plans of a GPU machine, tried on a machine without one).

The loop asks this for the device of its tensors, the budgets ``tierflow.fit`` takes and the
memory figures of its ``[T]`` lines; nothing else in the loop depends on the device.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.errors import BudgetError, TierflowError
from ..core.units import budget_to_give, format_bytes, parse_bytes
from ..exec.memory import return_free_memory, rss_bytes
from ..exec.stage_call import storage_key
from ..precision.config import BytesPerParameter
from ..profile.machine import load_gpu_runtime
from .options import TrainOptions

ALLOCATOR_SETTINGS = "expandable_segments:True"  # PYTORCH_CUDA_ALLOC_CONF under --gpu
# a model whose weights and AdamW states take less than this is built to measure the exact
# smallest --ram (cheap on any machine); a larger one is refused from its parameter count
BUILT_TO_MEASURE = 1 << 30
BUILD_BYTES = 4  # per parameter while a model is built: float32 (build_model), then cast


@dataclass(frozen=True)
class ParameterCount:
    """The parameters of the model a run trains (tied ones once), and how many of them train
    after ``--freeze`` and ``--train-only``."""
    total: int
    trainable: int


@dataclass(frozen=True)
class ComputeTier:
    device: torch.device
    simulated: bool  # a CPU run planned as on a GPU
    gpu: int | None  # the GPU's budget (real or simulated)
    ram: int | None  # host RAM's budget

    @classmethod
    def from_options(cls, opts: TrainOptions) -> "ComputeTier":
        """The tier ``opts`` ask for; one line when this machine cannot give it."""
        ram = parse_bytes(opts.ram, what="--ram") if opts.ram else None
        if opts.gpu is None:
            return cls(torch.device("cpu"), False, None, ram)
        gpu = parse_bytes(opts.gpu, what="--gpu")
        if opts.simulate_gpu:
            return cls(torch.device("cpu"), True, gpu, ram)
        if not torch.cuda.is_available():
            raise TierflowError(f"--gpu {opts.gpu} needs a CUDA GPU but torch sees none on this "
                                "machine: train on the CPU with --ram, or add --simulate-gpu "
                                "to plan and run the CPU as a GPU of that size")
        # growable segments, unless the user chose (read when CUDA first allocates): the
        # caching allocator then reserves about what it allocates, which is what the budget
        # counts (with fixed segments it reserved up to 36% more on an H100)
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOCATOR_SETTINGS)
        return cls(torch.device("cuda", torch.cuda.current_device()), False, gpu, ram)

    @property
    def name(self) -> str:
        if self.gpu is None:
            return "cpu"
        return "gpu (simulated on the CPU)" if self.simulated else \
            f"gpu ({torch.cuda.get_device_name(self.device)})"

    def fit_budgets(self, held: int = 0) -> dict[str, Any]:
        """The budget arguments of ``tierflow.fit``; ``held``: bytes of the RAM budget the
        process already takes (``held_outside_the_plan``)."""
        # at least a byte: a plan that cannot fit names what would
        ram = None if self.ram is None else max(1, self.ram - held)
        if self.gpu is None:
            return {"ram": ram}
        return {"gpu": self.gpu, "ram": ram}

    def held_outside_the_plan(self, model: nn.Module, baseline: int) -> int:
        """Bytes the process holds above its post-import RSS ``baseline`` besides the model's
        parameters in host RAM (which the plan counts): torch's kernels and thread pools on
        first use, a GPU's runtime (its context and kernel libraries),
        the model's own objects, what building it left allocated. ``--ram`` covers the whole
        run above that baseline while ``fit`` counts what is resident when it starts as
        outside its budget, so the trainer hands ``fit`` the budget less this. 0 without
        --ram, and on the simulated GPU (whose RAM is the process's, its --gpu included)."""
        if self.ram is None or self.simulated:
            return 0
        if self.device.type == "cuda":
            load_gpu_runtime(self.device)
        return_free_memory()
        params = {storage_key(p): p.untyped_storage().nbytes() for p in model.parameters()
                  if p.device.type == "cpu"}
        return max(0, rss_bytes() - baseline - sum(params.values()))

    def over_budget(self, error: BudgetError, held: int) -> BudgetError:
        """``error`` of a plan under the budget less ``held`` (RAM) in terms of --ram or
        --gpu, with a budget to give that leaves room for the sizes measured in the next
        run."""
        if error.tier == "ram" and self.ram is not None:
            flag, budget = "--ram", self.ram
        elif error.tier.startswith("gpu") and self.gpu is not None:
            flag, budget = "--gpu", self.gpu
        else:
            return error
        if error.tier != "ram":
            held = 0  # host RAM the process holds takes nothing of the GPU's
        need = error.smallest + held
        taken = ""
        if held:
            step = format_bytes(error.smallest, round_up=True)
            taken = (f" ({format_bytes(held)} is held before planning: torch's first-use "
                     f"caches, the model's objects; the step needs {step} more)")
        return BudgetError(
            f"{flag} {format_bytes(budget)} is below the smallest that works in this run, "
            f"{format_bytes(need, round_up=True)}{taken}: give {flag} {budget_to_give(need)} "
            "or more (what is measured before planning varies by a few MiB between runs)",
            tier=error.tier, budget=budget, smallest=need)

    def refuse_states_beyond_ram(self, model: str, parameters: ParameterCount,
                                 per: BytesPerParameter, ranks: int) -> None:
        """Before a run without --disk builds its model in RAM: one line when the weights of
        all ``parameters`` and the AdamW states of the trainable ones (``per`` each; master
        and moments sharded over ``ranks``), or the float32 model the build goes through
        (``BUILD_BYTES`` each, before bf16 weights are cast), alone pass --ram and
        BUILT_TO_MEASURE. Building a model that large would break the budget first (the
        out-of-memory killer may end the process before any plan refuses it); gradients,
        activations and the runtime come on top, so this is a floor, not the smallest
        budget that works, which a smaller model is built to measure."""
        if self.gpu is not None or self.ram is None:
            return
        state = per.optimizer_state / ranks
        floor = int(parameters.total * per.weights + parameters.trainable * state)
        built = parameters.total * BUILD_BYTES
        if max(floor, built) <= self.ram or max(floor, built) < BUILT_TO_MEASURE:
            return
        need = format_bytes(max(floor, built), round_up=True)
        way_out = (f"add --disk DIR to keep them on disk and stream them, or give --ram well "
                   f"above {need}")
        if built > floor:
            raise BudgetError(
                f"--ram {format_bytes(self.ram)} is below the {need} that building {model} "
                f"takes in RAM ({parameters.total:,} parameters x {BUILD_BYTES} bytes: it is "
                f"loaded in float32, then cast): {way_out}", tier="ram", budget=self.ram,
                smallest=built)
        sharded = f", over {ranks} ranks" if ranks > 1 else ""
        if parameters.trainable == parameters.total:
            what = f"{parameters.total:,} parameters x {per.weights + state:g} bytes{sharded}"
        else:
            what = (f"{parameters.total:,} parameters x {per.weights:g} bytes + the "
                    f"{parameters.trainable:,} trainable ones' states x {state:g}{sharded}")
        raise BudgetError(
            f"--ram {format_bytes(self.ram)} is below the {need} that the weights and AdamW "
            f"states of {model} take in RAM ({what}), before gradients and activations: "
            f"{way_out}", tier="ram", budget=self.ram, smallest=floor)

    def place_model(self, model: nn.Module) -> nn.Module:
        """``model`` moved whole to this tier's device (a run without --disk); one line
        instead of an out-of-memory error when its weights alone pass a CUDA --gpu."""
        if self.gpu is not None and not self.simulated:
            weights = sum(p.nbytes for p in model.parameters())
            if weights > self.gpu:
                raise TierflowError(
                    f"--gpu {format_bytes(self.gpu)} is below the model's "
                    f"{format_bytes(weights, round_up=True)} of weights: add --disk DIR to keep "
                    "the model in host RAM and stream it to the GPU, or raise --gpu")
        return model.to(self.device)

    def suggest_lower_tiers(self, error: BudgetError) -> BudgetError:
        """``error`` of a GPU plan that keeps everything on the GPU (no --disk), naming the
        other way out: with --disk tierflow owns AdamW and streams weights and its states
        from host RAM and the disk."""
        if self.gpu is None or not error.tier.startswith("gpu"):
            return error
        return BudgetError(f"{error}, or add --disk DIR to stream the weights and AdamW states "
                           "to the GPU from host RAM and that directory",
                           tier=error.tier, budget=error.budget, smallest=error.smallest)

    @property
    def plan_budget(self) -> int | None:
        """The budget the plan's compute tier has."""
        return self.gpu if self.gpu is not None else self.ram

    @property
    def rss_budget(self) -> int | None:
        """The budget the process's RSS is held to: host RAM, plus a simulated GPU's."""
        if self.simulated:
            return None if self.ram is None else self.ram + self.gpu
        return self.ram

    def gpu_peak(self) -> int | None:
        """Bytes the CUDA caching allocator held at its peak (None off CUDA)."""
        if self.device.type != "cuda":
            return None
        return int(torch.cuda.max_memory_allocated(self.device))

    def gpu_reserved_peak(self) -> int | None:
        """Bytes the CUDA caching allocator reserved from the driver at its peak (None off
        CUDA): what the GPU's other users could not have, allocated or cached."""
        if self.device.type != "cuda":
            return None
        return int(torch.cuda.max_memory_reserved(self.device))

    def describe(self) -> str:
        budgets = [f"{kind} {format_bytes(b)}" for kind, b in (("gpu", self.gpu),
                                                               ("ram", self.ram)) if b]
        return f"{self.name}; budgets: {', '.join(budgets) if budgets else 'none'}"
