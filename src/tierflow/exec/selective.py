"""Selective recomputation inside a stage: its taped forward keeps the outputs of its matmuls
and attention and drops everything else (norms, activations, rotary embeddings, residual adds
and other element-wise work), which its backward recomputes from what was kept.

PyTorch's own mechanism runs it: ``torch.utils.checkpoint`` without reentrancy, under the
dispatch modes of ``create_selective_checkpoint_contexts`` and the policy ``KeepMatmuls``.
What the stage saves for backward is then a cache of the kept outputs, held by the
checkpoint's frame, not tensors packed by the caller's ``saved_tensors_hooks``: the policy
itself records the bytes it keeps, which are the stage's tape. Weight casts (exec/recast.py)
are recomputed like any other cheap op, and offload hooks (exec/tapes.py) never see the
cache, so an offloaded tape and a selective forward exclude each other.

A stage that changes a kept output in place later in its forward (an in-place ReLU after a
batch norm) cannot run selectively: the recomputation would read the changed values.
``run_selective`` raises ``SelectiveUnsupported`` at the end of such a forward, before any
backward, and the profiler then measures no selective variant for it.

Exactness: the checkpoint restores the forward's RNG state for the recomputation
(``preserve_rng_state``), and an op that draws random numbers (attention with dropout) is
never kept, so the recomputation draws the same numbers in the same order. Batch norm with
running statistics is kept rather than run again, so the statistics move once per forward,
as in plain autograd.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from .storage import storage_bytes, storage_key

aten = torch.ops.aten
# the expensive ops: their outputs are kept
MATMULS = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten._scaled_mm.default, aten._int_mm.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._flash_attention_forward.default, aten._efficient_attention_forward.default,
})
# ops that update state outside the stage (running statistics): kept, never run twice
STATEFUL = frozenset({
    aten._native_batch_norm_legit.default, aten.native_batch_norm.default,
    aten.cudnn_batch_norm.default, aten._batch_norm_with_update.default,
})


class SelectiveUnsupported(ValueError):
    """The stage changed one of its kept outputs in place: it cannot run selectively."""


class KeepMatmuls:
    """The selective policy: keep the outputs of ``MATMULS`` that autograd records (grad
    mode on: the ops inside a custom ``autograd.Function``'s forward record nothing) and draw
    no random numbers, and of ``STATEFUL`` ops; recompute the rest. ``saved`` notes the
    storages kept (key -> bytes), which are the stage's tape, once ``note_kept`` has read
    them after the forward; ``recompute_seconds`` what the backward spent recomputing the
    rest (on an accelerator: launching its kernels)."""

    def __init__(self) -> None:
        self.saved: dict[int, int] = {}
        self.recompute_seconds = 0.0
        self._cache: dict | None = None  # the forward's cache of kept outputs, until read

    def __call__(self, ctx: SelectiveCheckpointContext, op: Any, *args: Any,
                 **kwargs: Any) -> CheckpointPolicy:
        keep = op in STATEFUL or (op in MATMULS and torch.is_grad_enabled()
                                  and not _draws_random(op, args, kwargs))
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    def contexts(self) -> tuple[Any, Any]:
        """``checkpoint``'s ``context_fn``: PyTorch's two selective modes, the forward's
        cache remembered so that ``note_kept`` can read what it kept, and the recomputation
        timed."""
        forward, recompute = create_selective_checkpoint_contexts(self)
        self._cache = forward.storage
        return forward, _Timed(recompute, self)

    def note_kept(self) -> bool:
        """Note the storages the forward kept in ``saved``; whether any of them was changed
        in place after it was kept. Reads the cache of PyTorch's caching mode (op key ->
        its kept outputs, a list before torch 2.13 and a dict of call index -> outputs
        since, each output wrapped with the version it was kept at): the policy sees the
        op's output itself only since torch 2.13. The cache is let go of afterwards, so the
        policy never holds the kept outputs past the stage's backward."""
        cache, self._cache = self._cache, None
        changed = False
        for entries in (cache or {}).values():
            calls = list(entries.values()) if isinstance(entries, dict) else list(entries)
            for wrapped in tree_leaves(calls):
                t = getattr(wrapped, "val", None)
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    self.saved[storage_key(t)] = storage_bytes(t)
                    changed = changed or t._version != wrapped.version
        return changed


class _Timed:
    """The recomputation's dispatch mode, entered and left as itself, its time added to the
    policy's ``recompute_seconds`` (the profiler prices a selective stage's backward by it:
    as the difference of two backwards' medians it was noise around zero on 2 cores)."""

    def __init__(self, mode: Any, policy: KeepMatmuls) -> None:
        self.mode = mode
        self.policy = policy
        self.started = 0.0

    def __enter__(self) -> Any:
        self.started = time.perf_counter()
        return self.mode.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self.mode.__exit__(*exc)
        finally:
            self.policy.recompute_seconds += time.perf_counter() - self.started


def _draws_random(op: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``op`` called with these arguments uses dropout (attention with dropout_p)."""
    names = [a.name for a in op._schema.arguments]
    if "dropout_p" not in names:
        return False
    at = names.index("dropout_p")
    p = kwargs.get("dropout_p", args[at] if at < len(args) else 0.0)
    return float(p) > 0.0


def run_selective(stage: Callable[..., torch.Tensor], x: torch.Tensor,
                  ctx: dict[str, Any]) -> tuple[torch.Tensor, KeepMatmuls]:
    """``stage(x, ctx)`` with autograd, keeping only what ``KeepMatmuls`` keeps; returns the
    output and the policy (its ``saved``: the bytes kept). Run it under the grad mode,
    autocast and hooks of the taped forward: the recomputation re-enters the same autocast.
    ``SelectiveUnsupported`` if the forward changed a kept output in place."""
    policy = KeepMatmuls()
    y = checkpoint(stage, x, ctx, use_reentrant=False, context_fn=policy.contexts,
                   preserve_rng_state=True)
    if policy.note_kept():
        raise SelectiveUnsupported(f"{type(stage).__name__} changes the output of a matmul "
                                   "or batch norm in place: it cannot run selectively")
    return y, policy
