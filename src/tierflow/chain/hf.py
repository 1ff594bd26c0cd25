"""Hugging Face causal LMs as a chain: embed, one stage per decoder layer, head (+ loss).

One adapter for every family shaped embeddings -> decoder layers -> final norm -> LM head
(Llama, Qwen2/3, Mistral, Gemma 1-3, GPT-2, GPT-NeoX, Mixtral, DeepSeek, GPT-OSS, Qwen3-Next,
...). It knows no family: ``hf_discover.py`` finds the layers, the body around them and the
final norm from the model's structure and one small run.

Everything the family computes between the embeddings and the first layer (causal mask,
sliding or chunked attention masks per layer type, rotary cos/sin, position ids, ...) comes
from running the model's own forward and catching each decoder layer's arguments with a
pre-hook (``hf_inputs.layer_inputs``). ``split_inputs`` does this once per step under
``no_grad`` and ``fork_rng`` (it consumes no random numbers, so a chain run draws the same
dropout masks as the plain model) and puts the per-layer arguments in ctx. The embed stage runs
the same forward with grad and stops at layer 0's pre-hook, so the embedding (and its dropout)
is computed exactly as the model computes it.

Stages: "embed" (x = input_ids or inputs_embeds -> hidden), "layers.i" (hidden -> hidden),
"head" (``hf_head.py``: the final norm, then the fused chunked LM head + loss, with final-logit
soft-capping and a mixture of experts' auxiliary loss, or else the model's own code after its
body). With tied embeddings the head stage and the embed stage hold the same Parameter.

``hf_chain`` checks its own result on a slice of the sample (``hf_verify.py``: logits, loss,
loss in training mode, the loss's gradient at the embeddings), with the fused head or else with
the model's own code; otherwise it raises UnsupportedModelError, naming the family and the
reason, before any step.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import nn

from .base import Chain, Context, UnsupportedModelError, call_args, module_signature
from .hf_carry import Carry
from .hf_discover import Parts, decoder_layers, find_parts, split_ownership
from .hf_head import BodyTailHead, FusedHead, ModelTailHead
from .hf_inputs import layer_inputs, model_mode, rng_devices, split_call, walk_tensors
from .hf_router import RouterLogits, find_routers, router_specs
from .hf_stages import EmbedStage, LayerStage
from .hf_verify import reference, verify

__all__ = ["decoder_layers", "hf_chain"]

_VERIFY_TOKENS = 8


def hf_chain(model: nn.Module, sample: Any, *, head_chunk_tokens: int = 1024) -> Chain:
    """Cut a causal LM into embed, decoder layers and head; UnsupportedModelError for a family
    it cannot train exactly."""
    cls = type(model).__name__
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(model, "it is an encoder-decoder model; only decoder-only "
                                    "causal LMs (embeddings -> layers -> norm -> head) chain")
    signature = inspect.signature(model.forward)
    args, kwargs = call_args(sample)
    x0, ctx0 = split_call(signature, args, kwargs, cls)
    input_key = ctx0["input_key"]
    tiny = x0[:1, :_VERIFY_TOKENS]
    probe_ctx = {**ctx0, "base_kwargs": {"use_cache": False}, "x0": tiny}
    with model_mode(model, False):
        parts = find_parts(model, {input_key: tiny, "use_cache": False})
    layers = parts.layers
    ref = reference(model, input_key, tiny, parts.reference.logits)

    _check_layer_loop(model, parts, ctx0, x0, probe_ctx, tiny)
    recorder, local = _recorder(parts)
    specs = router_specs(recorder)
    routers = [find_routers(layer, f"{local}.{i}", specs) for i, layer in enumerate(layers)]
    embed_parts, embed_loose, head_parts, head_loose = split_ownership(model, parts)
    heads = _heads(model, parts, head_parts, head_loose, any(routers), head_chunk_tokens)
    heads.append(lambda: BodyTailHead(model, parts.body, parts.body_output,
                                      {**embed_parts, **head_parts}, [*embed_loose, *head_loose],
                                      layers, parts.layer_output))

    def chain_with(carry: Carry | None) -> Chain:
        """The chain (carrying ``carry``'s side inputs), with the first head that verifies."""
        def split_inputs(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, Context]:
            x, ctx = split_call(signature, args, kwargs, cls)
            records_routers = any(routers) and ctx["base_kwargs"].get(
                "output_router_logits", getattr(config, "output_router_logits", False))
            ctx["router"] = RouterLogits() if records_routers else None
            with torch.no_grad(), torch.random.fork_rng(devices=rng_devices(x)):
                hidden, records = layer_inputs(model, layers, ctx, x, parts.layer_output)
            if carry is not None:
                ctx["hidden_shape"] = hidden.shape  # (B, T, h)
                ctx["carried_shapes"] = carry.shapes(records)
                records = carry.strip(records)
            ctx["layer_inputs"] = records
            return x, ctx

        def gather(ctx: Context, x: torch.Tensor) -> tuple[torch.Tensor, list]:
            return layer_inputs(model, layers, ctx, x, parts.layer_output)

        embed = EmbedStage(model, layers[0], embed_parts, embed_loose, carry, gather)
        stages = [embed, *[LayerStage(layer, i, routers[i], carry)
                           for i, layer in enumerate(layers)]]
        problem = ""
        for make in heads:
            head = make()
            chain = Chain(stages=[*stages, head],
                          names=["embed", *[f"layers.{i}" for i in range(len(layers))], "head"],
                          signatures=[module_signature(s) for s in [*stages, head]],
                          split_inputs=split_inputs, wrap_output=_wrap_output)
            problem = verify(model, chain, input_key, tiny, ref)
            if not problem:
                return chain
        raise UnsupportedModelError(model, problem)

    try:
        chain: Chain | None = chain_with(None)
    except UnsupportedModelError as refusal:  # perhaps for want of carried side inputs
        chain, first = None, refusal
    # Side inputs computed from parameters must travel in the chain (split_inputs computes
    # the others without grad). Last: a model on a disk tier keeps the weights this run
    # fetches with grad on (the embedding) until the caller's fetching ends, and the
    # verification's head beside them would take both at once
    with torch.enable_grad(), model_mode(model, False):
        _, records = layer_inputs(model, layers, probe_ctx, tiny, parts.layer_output)
    carry = Carry.find(records)
    if any(t.requires_grad for t in walk_tensors(
            records if carry is None else carry.strip(records))):
        raise UnsupportedModelError(model, "its decoder layers take inputs computed from "
                                    "parameters inside nested arguments, which a chain does "
                                    "not carry")
    if carry is not None:
        return chain_with(carry)
    if chain is None:
        raise first
    return chain


def _check_layer_loop(model: nn.Module, parts: Parts, ctx0: Context, x0: torch.Tensor,
                      probe_ctx: Context, tiny: torch.Tensor) -> None:
    """Refuse a model whose decoder loop does more than call its layers in turn."""
    # Random numbers drawn by the decoder loop itself (LayerDrop) cannot be replayed per stage;
    # the whole sample, as some families train on whole blocks only (Reformer)
    layers = parts.layers
    rng_states: list[torch.Tensor] = []
    with torch.no_grad(), torch.random.fork_rng(devices=rng_devices(x0)), \
            model_mode(model, True):
        layer_inputs(model, layers, ctx0, x0, parts.layer_output, rng_states)
    if any(not torch.equal(rng_states[0], s) for s in rng_states[1:]):
        raise UnsupportedModelError(model, "it draws random numbers between decoder layers "
                                    "(LayerDrop) in training mode, which a chain cannot replay")
    # What a layer takes besides the hidden states must not come from the layers before it
    # (Zaya's router states): the chain gives it as the model computes it with every layer
    # passed through. Only integers that do not change what the layer returns may differ so
    # (DeepSeek sparse attention's top-k indices, which a layer with its own indexer ignores)
    with torch.no_grad(), model_mode(model, False):
        _, passed = layer_inputs(model, layers, probe_ctx, tiny, parts.layer_output)
        for i, ((hidden, *real), given) in enumerate(zip(parts.layer_args, passed)):
            name, floating = _differing(tuple(real), given)
            if name and (floating or not _same_output(layers[i], hidden, tuple(real), given)):
                raise UnsupportedModelError(model, f"its decoder layer {i} takes an input "
                                            f"({name}) that the layers before it compute, which "
                                            "a chain does not carry")


def _differing(real: tuple[tuple, dict], given: tuple[tuple, dict]) -> tuple[str, bool]:
    """(the first of a layer's arguments, by position or name, whose tensors differ between
    the model's run and the chain's, whether any of them is floating point), ("", False) if
    none differs."""
    (real_args, real_kwargs), (args, kwargs) = real, given
    pairs = [(f"argument {k + 1}", a, b) for k, (a, b) in enumerate(zip(real_args, args))]
    pairs += [(k, v, kwargs.get(k)) for k, v in real_kwargs.items()]
    for name, a, b in pairs:
        ta, tb = list(walk_tensors(a)), list(walk_tensors(b))
        if len(ta) != len(tb) or any(x.shape != y.shape or not torch.equal(x, y)
                                     for x, y in zip(ta, tb)):
            return name, any(t.is_floating_point() for t in ta + tb)
    return "", False


def _same_output(layer: nn.Module, hidden: torch.Tensor, real: tuple[tuple, dict],
                 given: tuple[tuple, dict]) -> bool:
    """Whether ``layer`` returns the same on ``hidden`` with the model's arguments and with the
    chain's (False if it fails with the chain's)."""
    want = list(walk_tensors(layer(hidden, *real[0], **real[1])))
    try:
        got = list(walk_tensors(layer(hidden, *given[0], **given[1])))
    except Exception:  # noqa: BLE001 - it needs what only the layers before it give
        return False
    return len(got) == len(want) and all(
        x.shape == y.shape and torch.equal(x, y) for x, y in zip(got, want))


def _wrap_output(x: torch.Tensor, ctx: Context) -> Any:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if ctx.get("labels") is None:
        return CausalLMOutputWithPast(loss=None, logits=x)
    return CausalLMOutputWithPast(loss=x, logits=None)


def _recorder(parts: Parts) -> tuple[nn.Module, str]:
    """The innermost module around the layers that declares what transformers records
    (``_can_record_outputs``; the body when none does), and the layers' name inside it."""
    path = parts.layers_name.removeprefix(parts.body_name + ".").split(".")
    for depth in range(len(path) - 1, 0, -1):
        module = parts.body.get_submodule(".".join(path[:depth]))
        if getattr(module, "_can_record_outputs", None):
            return module, ".".join(path[depth:])
    return parts.body, ".".join(path)


def _heads(model: nn.Module, parts: Parts, head_parts: dict[str, nn.Module],
           head_loose: list[nn.Parameter], has_routers: bool,
           chunk_tokens: int) -> list[Callable[[], nn.Module]]:
    """Makers of the head stages to try, in order: the fused head where the model's LM head is
    an nn.Linear (adding the router loss with the weight the model holds for it, if it holds
    one: a family without a router loss holds none), then the model's own tail."""
    common = (model, parts.body, parts.body_output, parts.post, head_parts, head_loose)
    makers: list[Callable[[], nn.Module]] = []
    linear = model.get_output_embeddings()
    coefs = [v for k, v in vars(model).items()
             if k.endswith("aux_loss_coef") and isinstance(v, (int, float))] if has_routers else []
    if isinstance(linear, nn.Linear) and len(coefs) <= 1:
        softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
        makers.append(lambda: FusedHead(*common, linear, chunk_tokens, softcap or None,
                                        coefs[0] if coefs else None))
    makers.append(lambda: ModelTailHead(*common))
    return makers
