"""The head stage of a Hugging Face causal LM's chain: the final norm, then the LM head and the
loss. Three kinds, tried by ``hf.py`` in this order (the first that ``hf_verify`` passes):

- ``FusedHead``: the LM head and the shifted cross-entropy fused in chunks
  (``linear_cross_entropy``), so the (tokens, vocab) logits never exist; final-logit
  soft-capping applied inside the chunks; a mixture of experts' auxiliary loss added as the
  model adds it.
- ``ModelTailHead``: the causal LM's own forward after its body (head transforms, logit
  scaling, an unshifted loss, ...): exact for whatever the family computes there, at the cost
  of the full logits.
- ``BodyTailHead``: also the body's own code after its last layer, where the final-norm
  modules do not cover it (Gemma-3n's altup unembedding, CPM-Ant's prompt strip).

The first two call the model's own forward for what follows the body, with the body's forward
swapped for one that returns the stage's hidden states (``tail``). All hold the model's modules
outside the body (the LM head and anything beside it).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import Context
from .hf_inputs import passed_through
from .hf_stages import model_inputs


class _Head(nn.Module):
    def __init__(self, model: nn.Module, body: nn.Module, body_output: type,
                 post: list[nn.Module], parts: dict[str, nn.Module], loose: list[nn.Parameter]):
        super().__init__()
        self.post = nn.ModuleList(post)
        self.parts = nn.ModuleDict({k.replace(".", "_"): m for k, m in parts.items()})
        self.loose = nn.ParameterList(loose)  # parameters held directly by the model, outside
        self._refs = (model, body, body_output)  # not registered: not owned by this stage

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm (whatever the body runs after its last layer)."""
        for module in self.post:
            x = module(x)
        return x

    def tail(self, hidden: torch.Tensor, ctx: Context, **overrides: Any) -> Any:
        """The causal LM's own forward after its body, ``hidden`` standing for the body's
        output (with the step's router logits when it records them: hf_router.py)."""
        model, body, body_output = self._refs
        fields: dict[str, Any] = {"last_hidden_state": hidden}
        record = ctx.get("router")
        if record is not None:
            fields["router_logits"] = record.for_head(hidden)
        output = body_output(**fields)
        own = body.__dict__.get("forward")  # an instance's own forward (hooks), if any
        body.forward = lambda *args, **kwargs: output  # shadows the class's forward
        try:
            return model(**{**model_inputs(ctx, ctx["x0"]), **overrides})
        finally:
            if own is None:
                del body.forward
            else:
                body.forward = own


class FusedHead(_Head):
    """Final norm, then the fused chunked LM head + loss when ctx has labels (logits never
    materialised), else the logits; ``softcap``: the model's final-logit soft-capping;
    ``aux_coef``: the weight of the routers' auxiliary loss in the model's loss."""

    def __init__(self, model: nn.Module, body: nn.Module, body_output: type,
                 post: list[nn.Module], parts: dict[str, nn.Module], loose: list[nn.Parameter],
                 head: nn.Linear, chunk_tokens: int, softcap: float | None,
                 aux_coef: float | None):
        super().__init__(model, body, body_output, post, parts, loose)
        self._head = (head,)  # held through self.parts
        self.chunk_tokens = chunk_tokens
        self.softcap = softcap
        self.aux_coef = aux_coef

    def extra_repr(self) -> str:  # part of the signature: profiled per size
        return f"chunk_tokens={self.chunk_tokens}, softcap={self.softcap}"

    def forward(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        from ..kernels.linear_cross_entropy import linear_cross_entropy

        x = self.normed(x)
        head = self._head[0]
        labels = ctx.get("labels")
        if labels is None:
            logits = head(x)  # (B, T, V)
            if self.softcap is not None:  # the model's own order of operations
                logits = torch.tanh(logits / self.softcap) * self.softcap
            return logits
        loss = linear_cross_entropy(x, head.weight, labels, bias=head.bias,
                                    chunk_tokens=self.chunk_tokens, shift=ctx["shift"],
                                    softcap=self.softcap)
        num_items = ctx.get("num_items_in_batch")
        if num_items is not None:  # HF: sum over tokens / num_items_in_batch
            targets = labels[..., 1:] if ctx["shift"] else labels
            loss = loss * (targets != -100).sum() / num_items
        if ctx.get("router") is not None and self.aux_coef is not None:
            # the model's own auxiliary loss, its logits for one position only
            aux = self.tail(x, ctx, logits_to_keep=1).aux_loss
            loss = loss + self.aux_coef * aux.to(loss.device)
        return loss


class ModelTailHead(_Head):
    """Final norm, then the causal LM's own forward after its body: its loss with labels, else
    its logits."""

    def extra_repr(self) -> str:
        return "model tail"

    def forward(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        out = self.tail(self.normed(x), ctx, **ctx["label_args"])
        return out.loss if ctx.get("labels") is not None else out.logits


class BodyTailHead(_Head):
    """The model's own forward from its last decoder layer on: it runs from the start with
    every layer passed through and x put in at the first. What runs before the layers
    (embeddings, masks) runs again, without grad and with its random draws undone, and its
    result is dropped; so this stage also holds the modules the embed stage holds (shared
    with it, as a tied head is), for a plan that streams weights to fetch them."""

    def __init__(self, model: nn.Module, body: nn.Module, body_output: type,
                 parts: dict[str, nn.Module], loose: list[nn.Parameter], layers: nn.ModuleList,
                 container: tuple[type, int] | None):
        super().__init__(model, body, body_output, [], parts, loose)
        self._loop = (layers, container)

    def extra_repr(self) -> str:
        return "body tail"

    def forward(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        model = self._refs[0]
        layers, container = self._loop
        grad = torch.is_grad_enabled()
        devices = [x.device] if x.is_cuda else []
        state = (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices])

        def enter(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            torch.set_rng_state(state[0])  # the draws before the layers are undone
            for d, s in zip(devices, state[1]):
                torch.cuda.set_rng_state(s, d)
            torch.set_grad_enabled(grad)
            if args:
                return (x, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": x}

        handle = layers[0].register_forward_pre_hook(enter, with_kwargs=True)
        torch.set_grad_enabled(False)
        try:
            with passed_through(list(layers), container):
                out = model(**{**model_inputs(ctx, ctx["x0"]), **ctx["label_args"]})
        finally:
            handle.remove()
            torch.set_grad_enabled(grad)
        return out.loss if ctx.get("labels") is not None else out.logits
