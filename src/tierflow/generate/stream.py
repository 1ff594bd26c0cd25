"""``tierflow generate`` under a ``--ram`` budget below the model: which decoder layers stay in
RAM and which are streamed from the checkpoint.

When ``memory_needed`` (``memory.py``) is above the budget, ``plan_stream`` keeps the
weights outside the decoder layers (head, norms) in RAM with the KV cache, the activation
margin, the runtime and the page cache that reads take, reserves ``PREFETCH_SLOTS`` buffers of
one decoder layer each for streaming, and keeps as many decoder layers resident as the rest of
the budget holds, spread evenly over the depth (so that reads can run ahead during the resident
layers' compute). An input embedding the head does not share is not held at all: its rows are
read as they are looked up (``EmbeddingRows``). ``load_streamed`` builds the model on the meta
device, reads the resident tensors with ``pread`` into fresh tensors (dropping them from the
page cache), hands the other layers to a ``LayerStreamer`` and prints the plan on stderr:
resident layers, bytes read per token, and the tok/s the measured disk read bandwidth allows.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TextIO

import torch
from torch import nn

from ..core.errors import TierflowError
from ..core.units import format_bytes
from ..models.safetensors_io import StoredTensor, read_tensor
from .embedding_rows import EmbeddingRows
from .layer_stream import LayerStreamer, slot_bytes
from .memory import RUNTIME_BYTES, MemoryNeed, dtype_name, stored_tensors

PREFETCH_SLOTS = 2  # layer buffers: one computed from while the next is read
# What the page cache may hold of the checkpoint while layers stream: the chunk being read
# and the kernel's read-ahead past it (at most 28 MiB measured with 8 MiB read-ahead).
PAGE_CACHE_BYTES = 32 << 20


@dataclass
class StreamPlan:
    """Which decoder layers stay in RAM under ``budget``, and what that holds, in bytes."""

    resident: list[int]  # decoder layers kept in RAM, by index
    layer_bytes: list[int]  # each decoder layer in RAM (compute dtype)
    stored_bytes: list[int]  # each decoder layer in the checkpoint (read when streamed)
    other_bytes: int  # the weights outside the decoder layers held in RAM (head, norms, ...)
    slot_bytes: int  # one streaming buffer (a layer, plus its converted copy if any)
    slots: int
    kv_cache: int
    activations: int
    budget: int
    rows_on_demand: bool = False  # the input embedding's rows are read as they are looked up
    runtime: int = RUNTIME_BYTES
    page_cache: int = PAGE_CACHE_BYTES

    @property
    def streamed(self) -> list[int]:
        return [i for i in range(len(self.layer_bytes)) if i not in self.resident]

    @property
    def resident_bytes(self) -> int:
        return self.other_bytes + sum(self.layer_bytes[i] for i in self.resident)

    @property
    def ram(self) -> int:
        """What the plan holds: resident weights, buffers, KV cache, activations, runtime,
        and the page cache that reading takes."""
        return (self.resident_bytes + self.slots * self.slot_bytes + self.kv_cache
                + self.activations + self.runtime + self.page_cache)

    @property
    def bytes_per_token(self) -> int:
        """Bytes read from the checkpoint per forward pass (per new token)."""
        return sum(self.stored_bytes[i] for i in self.streamed)

    def describe(self, bandwidth: float) -> list[str]:
        """The plan in words, with the tok/s that ``bandwidth`` (bytes/s read) allows."""
        n, res = len(self.layer_bytes), self.resident
        tok_s = bandwidth / self.bytes_per_token
        rows = "; the input embedding's rows are read as looked up" if self.rows_on_demand else ""
        return [
            f"{len(res)} of {n} decoder layers stay in RAM ({', '.join(map(str, res)) or 'none'}),"
            f" {len(self.streamed)} are read from the checkpoint for every forward pass into "
            f"{self.slots} buffers of {format_bytes(self.slot_bytes)}",
            f"RAM: weights {format_bytes(self.resident_bytes)} (outside the decoder layers "
            f"{format_bytes(self.other_bytes)}{rows}) + buffers "
            f"{format_bytes(self.slots * self.slot_bytes)} + KV cache "
            f"{format_bytes(self.kv_cache)} + activations {format_bytes(self.activations)} + "
            f"runtime {format_bytes(self.runtime)} + page cache {format_bytes(self.page_cache)} "
            f"= {format_bytes(self.ram)} of {format_bytes(self.budget)}",
            f"{format_bytes(self.bytes_per_token)} read per token at {bandwidth / 1e9:.3g} GB/s "
            f"(measured reading layers before the first token) -> predicted {tok_s:.2f} tok/s "
            "(disk-bound)",
        ]


def _spread(n: int, k: int) -> list[int]:
    """``k`` of ``range(n)``, evenly spaced."""
    return [int((j + 0.5) * n / k) for j in range(k)]


def plan_stream(layer_bytes: list[int], stored_bytes: list[int], other_bytes: int,
                slot_size: int, need: MemoryNeed, budget: int, *, slots: int = PREFETCH_SLOTS,
                rows_on_demand: bool = False, page_cache: int = PAGE_CACHE_BYTES) -> StreamPlan:
    """The plan with the most resident decoder layers that fits ``budget``; when none fits,
    the plan with none (its ``ram`` is then the smallest budget, above ``budget``)."""
    def plan(resident: list[int]) -> StreamPlan:
        return StreamPlan(resident, layer_bytes, stored_bytes, other_bytes, slot_size, slots,
                          need.kv_cache, need.activations, budget, rows_on_demand,
                          page_cache=page_cache)
    for k in range(len(layer_bytes) - 1, 0, -1):
        candidate = plan(_spread(len(layer_bytes), k))
        if candidate.ram <= budget:
            return candidate
    return plan([])


def _model_names(model: nn.Module, stored: dict[str, StoredTensor],
                 directory: Path) -> dict[str, StoredTensor]:
    """{parameter or buffer name in ``model``: its stored tensor}, for every unique parameter
    (under any of its tied names) and the persistent buffers the checkpoint holds."""
    from ..models.load import _match_names, _short
    by_model_name = {model_name: stored[name]
                     for name, model_name in _match_names(model, set(stored)).items()}
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    found, missing = {}, []
    for aliases in names.values():
        hit = next((a for a in aliases if a in by_model_name), None)
        if hit is None:
            missing.append(aliases[0])
        else:
            found[aliases[0]] = by_model_name[hit]
    found.update({name: by_model_name[name] for name, _ in model.named_buffers()
                  if name in by_model_name})
    state = model.state_dict(keep_vars=True)
    wrong = [n for n, t in found.items() if tuple(state[n].shape) != t.shape]
    if missing or wrong:
        what = (f"{len(missing)} tensors missing ({_short(missing)})" if missing else
                f"{len(wrong)} with another shape ({_short(wrong)})")
        raise TierflowError(f"the weights in {directory} do not match its config.json "
                            f"({model.config.model_type}): {what}: use the config.json saved "
                            "with these weights")
    return found


def _set(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Point parameter (or buffer) ``name`` and every name tied to it at ``tensor``."""
    module_name, _, leaf = name.rpartition(".")
    old = model.get_submodule(module_name)._parameters.get(leaf)
    if old is None:
        model.get_submodule(module_name)._buffers[leaf] = tensor
        return
    new = nn.Parameter(tensor, requires_grad=False)
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is old:
                module._parameters[key] = new


@dataclass
class Streaming:
    """What reads a streamed model's weights during generation; ``close`` it when done."""

    layers: LayerStreamer
    embedding: EmbeddingRows | None

    def summary(self) -> str:
        rows = (f"; {self.embedding.rows_read} embedding rows read"
                if self.embedding is not None else "")
        return self.layers.summary() + rows

    def close(self) -> None:
        self.layers.close()
        if self.embedding is not None:
            self.embedding.close()


def _rows_on_demand(model: nn.Module, name_of: dict[int, str],
                    found: dict[str, StoredTensor]) -> str | None:
    """The input embedding's parameter name when its rows can be read as looked up: a plain
    ``nn.Embedding`` whose table the head does not share (a tied head reads all of it)."""
    embedding = model.get_input_embeddings()
    if not isinstance(embedding, nn.Embedding) or embedding.max_norm is not None:
        return None
    uses = [p for _, p in model.named_parameters(remove_duplicate=False)
            if p is embedding.weight]
    name = name_of.get(id(embedding.weight))
    return name if len(uses) == 1 and name in found else None


def _int8_tip(dtype: torch.dtype, found: dict[str, StoredTensor], layer: list[str]) -> str:
    """What an int8 copy would change: bytes per linear weight in RAM and read."""
    stored = max((found[n] for n in layer), key=lambda t: t.nbytes).dtype.itemsize
    return (f"an int8 copy of this checkpoint (tierflow quantize; the text differs slightly) "
            f"holds and reads 1 byte per linear weight, where this run holds "
            f"{dtype.itemsize} and reads {stored}")


def load_streamed(directory: Path, dtype: torch.dtype, need: MemoryNeed, budget: int, *,
                  ram_text: str, prompt_tokens: int, max_new_tokens: int,
                  vocab_size: int | None, log: TextIO,
                  before_reading: Callable[[], object] | None = None,
                  ) -> tuple[nn.Module, Streaming]:
    """The causal LM in ``directory`` with the decoder layers ``plan_stream`` cannot keep in
    RAM streamed from the checkpoint, and the input embedding's rows read as looked up when
    the head does not share it (the streaming is running: ``close`` it when done). Refuses,
    naming the smallest budget, when even streaming every decoder layer does not fit;
    ``before_reading`` is called once the plan fits, before a weight is read (``--enforce``
    enters its memory cgroup there)."""
    from ..chain.hf import decoder_layers
    from ..models.int8 import is_quantized
    from ..models.load import build_on_meta, read_config
    config = read_config(directory)
    if vocab_size is not None and vocab_size > config.vocab_size:
        raise TierflowError(f"the tokenizer's vocabulary ({vocab_size}) is larger than the "
                            f"model's ({config.vocab_size} in {directory / 'config.json'}): "
                            "tokenize with the model's own tokenizer")
    model = build_on_meta(directory, dtype, config=config, for_generation=True).eval()
    found = _model_names(model, stored_tensors(directory), directory)
    state = model.state_dict(keep_vars=True)
    name_of = {id(p): n for n, p in model.named_parameters()}
    layers = decoder_layers(model.base_model)[1]
    per_layer = [[name_of[id(p)] for p in layer.parameters()] for layer in layers]
    in_layers = {n for names in per_layer for n in names}
    rows = _rows_on_demand(model, name_of, found)
    plan = plan_stream([sum(state[n].nbytes for n in names) for names in per_layer],
                       [sum(found[n].nbytes for n in names) for names in per_layer],
                       sum(state[n].nbytes for n in found if n not in in_layers and n != rows),
                       slot_bytes([[(state[n], found[n]) for n in names] for names in per_layer]),
                       need, budget, rows_on_demand=rows is not None,
                       page_cache=min(PAGE_CACHE_BYTES, sum(t.nbytes for t in found.values())))
    if plan.ram > budget:
        in_ram = need.total + RUNTIME_BYTES  # may be less: streaming has its own costs
        raise TierflowError(
            f"--ram {ram_text} is too small to generate {max_new_tokens} tokens after a "
            f"{prompt_tokens}-token prompt in {dtype_name(dtype)}: streaming every decoder layer "
            f"needs weights {format_bytes(plan.resident_bytes, round_up=True)} (outside the "
            f"decoder layers) + {plan.slots} layer buffers "
            f"{format_bytes(plan.slots * plan.slot_bytes, round_up=True)} + KV cache "
            f"{format_bytes(plan.kv_cache, round_up=True)} + activations "
            f"{format_bytes(plan.activations, round_up=True)} + runtime "
            f"{format_bytes(plan.runtime, round_up=True)} + page cache "
            f"{format_bytes(plan.page_cache, round_up=True)}, every weight in RAM "
            f"{format_bytes(in_ram, round_up=True)}; give --ram "
            f"{format_bytes(min(plan.ram, in_ram), round_up=True)} or more, or lower "
            "--max-new-tokens" + ("" if is_quantized(config) else ", or generate from an int8 "
                                  "copy (tierflow quantize: 1 byte per linear weight)"))
    if before_reading is not None:
        before_reading()
    streamed = {n for i in plan.streamed for n in per_layer[i]}
    fds = {file: os.open(file, os.O_RDONLY) for file in {t.file for t in found.values()}}
    try:
        for name, tensor in found.items():
            if name not in streamed and name != rows:
                _set(model, name, read_tensor(fds[tensor.file], tensor, state[name].dtype))
    finally:
        for fd in fds.values():
            os.close(fd)
    for name in streamed | ({rows} if rows else set()):  # CPU placeholders, swapped when used
        _set(model, name, torch.empty(0, dtype=state[name].dtype))
    embedding = EmbeddingRows(model.get_input_embeddings(), found[rows]) if rows else None
    streamer = LayerStreamer([(layers[i], [(model.get_parameter(n), found[n])
                                           for n in per_layer[i]]) for i in plan.streamed],
                             plan.slots)
    streamer.start()  # reads the first streamed layers: the disk's bandwidth
    for line in [f"--ram {ram_text} is below the {format_bytes(need.total + RUNTIME_BYTES)} "
                 "that generation needs with every weight in RAM",
                 *plan.describe(streamer.disk_bandwidth),
                 *([] if is_quantized(config) else [_int8_tip(dtype, found, per_layer[0])])]:
        print(f"[stream] {line}", file=log, flush=True)
    return model, Streaming(streamer, embedding)
