"""AdamW whose moments are stored in fp32, bf16 or blockwise int8, for fp32 or bf16 weights.

The arithmetic of a step is ``torch.optim.AdamW``'s (single-tensor path, same hyper-parameters,
decoupled weight decay and bias correction), done in float32 on float32 working copies:

- fp32 weights and fp32 moments: the state tensors are updated in place, op for op as torch
  does, so the result equals ``torch.optim.AdamW``;
- bf16 weights with ``master="fp32"``: the state holds an fp32 master copy; the update goes
  there and the weights get it rounded to nearest;
- bf16 weights with ``master="none"``: the weights are read as fp32, updated and written back
  with stochastic rounding (``rounding.py``);
- bf16 moments are written back with stochastic rounding (round-to-nearest would freeze v: a
  0.999 decay is below half a bf16 ulp); int8 moments are re-quantized (``quant.py``).

A parameter is updated CHUNK (4M) elements at a time in float32 scratch vectors of one slice,
allocated once per step (``_workspace``: the gradient, working weights and moments as
float32, the denominator). Decoding int8 moments reads the codes' signs in the denominator's
vector before it is computed; int8 quantization and stochastic rounding compute in it once
the weights are updated, and the rounding writes straight into the bf16 state. So a step
allocates its workspace and nothing else of a slice's size: 1 to 5 times 16 MiB (16 MiB for
fp32 weights and moments, 48 MiB for int8 or bf16 moments, 16 MiB more for bf16 weights,
16 more for their stochastic rounding) even for a 32000 x 2048 embedding (256 MiB per
float32 temporary of it otherwise; tests/test_precision_numerics.py reads the kernel's
high-water mark around a step). The trainer
measures them and plans room for them (``train/optimizer.step_transient_bytes``). Every
operation is element-wise, int8 slices start on block boundaries, and a stochastic rounding's
noise is a hash of each element's index in the parameter and a seed drawn once per parameter
and step, so the result equals one pass over the whole tensor.

Weights in host RAM with fp32 or bf16 moments, when a step has enough of them
(``fused_adamw.FUSED_MIN_ELEMENTS``), are stepped by one compiled kernel instead
(``fused_adamw.py``: the same arithmetic and noise in one pass over memory, no workspace).

``state_dict()`` holds only tensors and plain numbers: per parameter ``step`` (a 0-dim float32
tensor, as ``torch.optim.AdamW`` saves it, so that a checkpoint names the same tensors whether
one process or ZeRO shards wrote it; the optimizer itself keeps an int),
``exp_avg``/``exp_avg_sq`` (fp32, bf16, or int8/uint8 codes with ``exp_avg_scale`` and
``exp_avg_sq_scale`` float32 per block), ``master`` (fp32) when kept; and, when stochastic
rounding is used, ``generator``: the random generator's state as a uint8 tensor. That fits the
trainer's safetensors + JSON codec (``train/codec.py``). ``load_state_dict`` keeps every stored
dtype (torch's own would cast codes and masters to the parameter's dtype).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from .config import BLOCK, MASTERS, OPTIM_DTYPES, PrecisionError
from .quant import SIGNED, UNSIGNED, blocks, dequantize_into, empty_codes, quantize_
from .fused_adamw import (FUSED_MIN_ELEMENTS, FUSED_MIN_ELEMENTS_EXACT, fused_step,
                          hyper_parameters, kernel_unavailable)
from .rounding import generator_for, stochastic_round_bf16

_MAPPINGS = {"exp_avg": SIGNED, "exp_avg_sq": UNSIGNED}
CHUNK = 1 << 22  # elements updated at a time (a multiple of BLOCK): 16 MiB float32 temporaries


class AdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` with low-precision storage (see the module docstring).

    moment_dtype: "fp32", "bf16" or "int8"; master: "fp32" or "none" (used for bf16 weights;
    fp32 weights are their own master). seed: of the stochastic-rounding generator; None
    draws it from torch's global generator once, at construction, so ``torch.manual_seed``
    makes a run reproducible and each optimizer (one per tierflow stage) gets its own stream.
    generator: a stochastic-rounding generator shared with other optimizers instead (seed is
    then unused): tierflow's per-stage optimizers draw from one stream, saved once.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, moment_dtype: str = "fp32",
                 master: str = "fp32", seed: int | None = None,
                 generator: torch.Generator | None = None):
        if moment_dtype not in OPTIM_DTYPES:
            raise PrecisionError(f"moment_dtype={moment_dtype!r} is unknown: use one of "
                                 f"{', '.join(OPTIM_DTYPES)}")
        if master not in MASTERS:
            raise PrecisionError(f"master={master!r} is unknown: use one of {', '.join(MASTERS)}")
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise PrecisionError(f"AdamW needs lr, eps, weight_decay >= 0 and betas in [0, 1), "
                                 f"got lr={lr}, eps={eps}, weight_decay={weight_decay}, "
                                 f"betas={betas}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps,
                                  "weight_decay": weight_decay})
        self.moment_dtype = moment_dtype
        self.master = master
        all_params = [p for g in self.param_groups for p in g["params"]]
        for p in all_params:
            if p.dtype not in (torch.float32, torch.bfloat16):
                raise PrecisionError(f"a parameter of shape {tuple(p.shape)} is {p.dtype}: this "
                                     "AdamW updates float32 or bfloat16 weights; cast the model")
            if not p.is_contiguous():
                raise PrecisionError(f"a parameter of shape {tuple(p.shape)} is not contiguous: "
                                     "this AdamW updates flat slices; make it contiguous")
        devices = {p.device for p in all_params}
        if len(devices) > 1:
            raise PrecisionError(f"parameters on {len(devices)} devices "
                                 f"({sorted(map(str, devices))}): make one optimizer per device")
        rounds = moment_dtype == "bf16" or (
            master == "none" and any(p.dtype == torch.bfloat16 for p in all_params))
        self._generator: torch.Generator | None = None
        if rounds and generator is not None:
            device = next(iter(devices))
            if generator.device.type != device.type:
                raise PrecisionError(f"the stochastic-rounding generator is on "
                                     f"{generator.device}, the parameters on {device}: give a "
                                     "generator on the parameters' device")
            self._generator = generator
        elif rounds:
            if seed is None:
                seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
            self._generator = generator_for(devices.pop(), seed)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        updated = [(p, group) for group in self.param_groups for p in group["params"]
                   if p.grad is not None]
        if not updated:
            return loss
        fused = self._fusable([p for p, _ in updated])
        unfused = [p for p, _ in updated if p not in fused]
        scratch = self._workspace(unfused) if unfused else {}
        for p, group in updated:
            self._update(p, group, scratch, p in fused)
        return loss

    def _fusable(self, params: list[torch.Tensor]) -> set[torch.Tensor]:
        """The parameters this step may update with the fused kernel (``fused_adamw.py``):
        dense fp32 or bf16 weights in host RAM with fp32 or bf16 moments, when there are at
        least FUSED_MIN_ELEMENTS of them, or FUSED_MIN_ELEMENTS_EXACT where nothing rounds
        stochastically (fewer would not repay the compiler's seconds)."""
        if self.moment_dtype not in ("fp32", "bf16") or kernel_unavailable():
            return set()
        fusable = {p for p in params if p.dtype in (torch.float32, torch.bfloat16)
                   and p.device.type == "cpu" and not p.grad.is_sparse}
        rounds = self.moment_dtype == "bf16" or (
            self.master == "none" and any(p.dtype == torch.bfloat16 for p in fusable))
        least = FUSED_MIN_ELEMENTS if rounds else FUSED_MIN_ELEMENTS_EXACT
        return fusable if sum(p.numel() for p in fusable) >= least else set()

    def _workspace(self, params: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The step's float32 scratch vectors, one block for the whole step: every slice of
        every parameter works in them (the gradient, working weights and moments as float32,
        the denominator). A fresh tensor per operation, sized by each parameter, left
        malloc's heap fragmented: a llama-20m step grew the RSS 5 to 17 MiB past what it
        allocated at once. Each vector holds a slice of up to CHUNK elements, padded to whole
        int8 blocks."""
        names = ["denom"]
        if any(p.grad.dtype != torch.float32 for p in params):
            names.append("grad")
        if self.master == "none" and any(p.dtype != torch.float32 for p in params):
            names.append("weights")
        if self.moment_dtype != "fp32":
            names += ["exp_avg", "exp_avg_sq"]
        length = min(CHUNK, blocks(max(p.numel() for p in params)) * BLOCK)
        block = torch.empty(len(names), length, dtype=torch.float32, device=params[0].device)
        return dict(zip(names, block))

    def _update(self, p: torch.Tensor, group: dict, scratch: dict[str, torch.Tensor],
                fused: bool) -> None:
        if p.grad.is_sparse:
            raise PrecisionError("AdamW does not support sparse gradients: use dense embeddings")
        state = self.state[p]
        if not state:
            self._init_state(p, state)
        state["step"] += 1
        # the seeds of this step's two hashes, each for the whole parameter (its slices pass
        # their offsets): the low and high halves of the first round exp_avg and exp_avg_sq,
        # the low half of the second the weights
        # (int64 (2,), on the generator's device: read there, never brought to the host)
        seeds = torch.randint(0, 1 << 32, (2,), dtype=torch.int64, generator=self._generator,
                              device=self._generator.device) \
            if self._generator is not None else None
        if fused:
            master = state.get("master")
            if fused_step(p.view(-1), p.grad.reshape(-1), state["exp_avg"].view(-1),
                          state["exp_avg_sq"].view(-1),
                          None if master is None else master.view(-1), seeds,
                          hyper_parameters(group["lr"], group["betas"], group["eps"],
                                           group["weight_decay"], state["step"])):
                return
            scratch = self._workspace([p])  # the kernel failed to compile: once, this step
        numel = p.numel()
        for start in range(0, numel, CHUNK):
            self._update_slice(p, state, group, start, min(start + CHUNK, numel), scratch,
                               seeds)

    def _update_slice(self, p: torch.Tensor, state: dict, group: dict, start: int,
                      stop: int, scratch: dict[str, torch.Tensor],
                      seeds: torch.Tensor | None) -> None:
        """Update elements [start, stop) of the flattened ``p`` in the ``scratch`` vectors;
        ``seeds``: of the two hashes that round the moments and the weights (None: nothing
        is rounded stochastically)."""
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        n = stop - start
        flat = p.view(-1)[start:stop]  # (n,) a view: written in place
        grad = p.grad.reshape(-1)[start:stop]  # (n,)
        if grad.dtype != torch.float32:
            grad = scratch["grad"][:n].copy_(grad)
        master = state.get("master")
        if p.dtype == torch.float32:
            weights = flat
        elif master is not None:
            weights = master.view(-1)[start:stop]
        else:  # a working copy, stochastically rounded back
            weights = scratch["weights"][:n].copy_(flat)
        step = state["step"]
        if weight_decay != 0:
            weights.mul_(1 - lr * weight_decay)
        exp_avg = self._load(state, "exp_avg", start, stop, scratch)
        exp_avg_sq = self._load(state, "exp_avg_sq", start, stop, scratch)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        step_size = lr / bias_correction1
        denom = torch.sqrt(exp_avg_sq, out=scratch["denom"][:n])
        denom.div_(bias_correction2 ** 0.5).add_(eps)
        weights.addcdiv_(exp_avg, denom, value=-step_size)
        moments_seed = seeds[0] if seeds is not None else None
        self._store(state, "exp_avg", exp_avg, start, stop, scratch["denom"], moments_seed, 0)
        self._store(state, "exp_avg_sq", exp_avg_sq, start, stop, scratch["denom"],
                    moments_seed, 1)
        if p.dtype == torch.float32:
            return  # the weights were updated in place
        if master is not None:
            flat.copy_(weights)  # round to nearest: the master keeps what bf16 cannot
        else:
            stochastic_round_bf16(weights, seeds[1], scratch["denom"], out=flat, offset=start)

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        state["step"] = 0
        for key, mapping in _MAPPINGS.items():
            if self.moment_dtype == "int8":
                state[key], state[f"{key}_scale"] = empty_codes(p.numel(), mapping, p.device)
            else:
                dtype = torch.float32 if self.moment_dtype == "fp32" else torch.bfloat16
                state[key] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        if p.dtype == torch.bfloat16 and self.master == "fp32":
            state["master"] = p.to(torch.float32)

    def _load(self, state: dict, key: str, start: int, stop: int,
              scratch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Elements [start, stop) of moment ``key`` as a float32 vector: a view of the state
        when it is stored in float32, else decoded into ``scratch[key]``."""
        stored = state[key]
        if self.moment_dtype == "fp32":
            return stored.view(-1)[start:stop]
        if self.moment_dtype == "int8":
            codes, scales = self._codes(state, key, start, stop)
            out = scratch[key][:codes.numel()]  # whole blocks
            # the denominator's vector is free until the moments are loaded
            return dequantize_into(out, codes, scales, _MAPPINGS[key],
                                   scratch["denom"])[:stop - start]
        return scratch[key][:stop - start].copy_(stored.view(-1)[start:stop])

    def _store(self, state: dict, key: str, value: torch.Tensor, start: int, stop: int,
               work: torch.Tensor, seed: torch.Tensor | None, half: int) -> None:
        """Write moment ``key``'s elements [start, stop) back from ``value``, computing in
        the float32 vector ``work`` (the denominator's, free once the weights are updated);
        ``seed`` and ``half``: of its stochastic rounding's noise (``rounding.noise16``)."""
        if self.moment_dtype == "int8":
            codes, scales = self._codes(state, key, start, stop)
            quantize_(value, codes, scales, _MAPPINGS[key], work)
        elif self.moment_dtype == "bf16":
            stochastic_round_bf16(value, seed, work, out=state[key].view(-1)[start:stop],
                                  offset=start, half=half)
        # fp32: ``value`` is a view of the state tensor, updated in place

    @staticmethod
    def _codes(state: dict, key: str, start: int, stop: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the int8 codes and scales of elements [start, stop): ``start`` is a
        multiple of BLOCK (so is CHUNK); the last slice runs on to the padded end."""
        first, count = start // BLOCK, blocks(stop - start)
        return (state[key][start:start + count * BLOCK],
                state[f"{key}_scale"][first:first + count])

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["state"] = {i: {**s, "step": torch.tensor(float(s["step"]), dtype=torch.float32)}
                          for i, s in state["state"].items()}  # as torch's AdamW saves it
        if self._generator is not None:
            state["generator"] = self._generator.get_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a ``state_dict()`` exactly: stored dtypes, steps and the generator."""
        saved = state_dict["state"]
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for index, p in zip(ids, params):
            if index in saved:
                self.state[p] = {k: _restored(k, v, p.device) for k, v in saved[index].items()}
        generator = state_dict.get("generator")
        if (generator is None) != (self._generator is None):
            raise PrecisionError("the optimizer state and this optimizer disagree on stochastic "
                                 "rounding: resume with the same model_dtype, master and "
                                 "optim_dtype the state was saved with")
        if generator is not None:
            self._generator.set_state(generator.to(torch.uint8))



def _restored(key: str, value: Any, device: torch.device) -> Any:
    """A saved state value as the optimizer keeps it: tensors copied to ``device`` in their
    stored dtype, ``step`` an int (``state_dict`` and ZeRO gathering carry it as a tensor)."""
    if key == "step":
        return int(value)
    return value.to(device, copy=True) if isinstance(value, torch.Tensor) else value
