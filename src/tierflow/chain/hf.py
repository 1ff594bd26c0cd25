"""Hugging Face causal LMs as a chain: embed, one stage per decoder layer, head (+ loss).

One adapter for every family shaped embeddings -> decoder layers -> final norm -> LM head
(Llama, Qwen2, Mistral, GPT-2, GPT-NeoX, Gemma, Phi-3, OLMo, ...). It knows no family. It finds:

- the decoder layers: the largest ``nn.ModuleList`` under ``model.base_model`` (the outermost
  one when sizes tie, never one nested in another list);
- the final norm: the siblings of that list that the model calls after the last layer, found by
  recording call order with hooks during one small no-grad run;
- the head: ``model.get_output_embeddings()``, an ``nn.Linear``.

Everything the family computes between the embeddings and the first layer (causal mask, rotary
cos/sin, position ids, ...) is obtained by running the base model's own forward and catching the
arguments of each decoder layer with a forward pre-hook: layers 0..n-2 are swapped for a
pass-through during that run and the last layer's pre-hook stops it. ``split_inputs`` does this
once per step under ``no_grad`` and ``fork_rng`` (it consumes no random numbers, so a chain run
draws the same dropout masks as the plain model) and puts the per-layer arguments in ctx.
The embed stage runs the same forward with grad and stops at layer 0's pre-hook, so the
embedding (and its dropout) is computed exactly as the model computes it.

Stages: "embed" (x = input_ids or inputs_embeds -> hidden), "layers.i" (hidden -> hidden),
"head" (final norm, then the loss through ``linear_cross_entropy`` when labels are given, so
the (tokens, vocab) logits never exist, else the logits). With tied embeddings (GPT-2,
``tie_word_embeddings``) the head stage and the embed stage hold the same Parameter.

``hf_chain`` checks its own result on a slice of the sample (one sequence, at most 8 tokens,
eval mode): logits and loss must match the model's, otherwise it raises ChainError.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from .base import Chain, ChainError, Context, call_args, module_signature
from .hf_stages import EmbedStage, HeadStage, LayerStage, Stop, hidden_arg

# Config fields of families whose head does more than norm + linear; checked up front so the
# error names the feature. Anything else that differs is caught by the verification run.
_HEAD_FEATURES = {
    "final_logit_softcapping": "final logit soft-capping",
    "logit_scale": "logit scaling",
    "logits_scaling": "logit scaling",
    "lm_head_multiplier": "LM-head multiplier",
    "output_multiplier_scale": "output multiplier",
}
# Arguments of the causal-LM forward that do not go to the base model.
_HEAD_ARGS = ("labels", "shift_labels", "logits_to_keep", "return_dict")
_VERIFY_TOKENS = 8


# ---------------------------------------------------------------------------- discovery


def decoder_layers(base: nn.Module) -> tuple[str, nn.ModuleList]:
    """The name and the list of ``base``'s decoder layers: its longest ``nn.ModuleList`` not
    nested in another one."""
    best: tuple[str, nn.ModuleList] | None = None
    inside: list[str] = []  # ModuleLists already seen: lists nested in them do not count
    for name, module in base.named_modules():
        if not isinstance(module, nn.ModuleList):
            continue
        if any(name.startswith(p + ".") for p in inside):
            continue
        inside.append(name)
        if best is None or len(module) > len(best[1]):
            best = (name, module)
    if best is None or len(best[1]) == 0:
        raise ChainError(f"{type(base).__name__} has no nn.ModuleList of decoder layers: "
                         "it is not an embeddings -> layers -> norm -> head causal LM; "
                         "pass a tracer-friendly module or an nn.Sequential instead")
    return best


@contextmanager
def _mode(model: nn.Module, training: bool) -> Iterator[None]:
    flags = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def _rng_devices(*tensors: Any) -> list[torch.device]:
    return sorted({t.device for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda},
                  key=str)


def _layer_inputs(base: nn.Module, layers: nn.ModuleList, base_kwargs: dict[str, Any],
                  returns_tuple: bool, rng_states: list[torch.Tensor] | None = None
                  ) -> list[tuple[tuple, dict]]:
    """Run ``base`` with layers 0..n-2 passed through; catch every layer's other arguments."""
    n = len(layers)
    records: list[tuple[tuple, dict] | None] = [None] * n

    def catcher(i: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            records[i] = (tuple(args[1:]), rest)
            if rng_states is not None:
                rng_states.append(torch.get_rng_state())
            if i == n - 1:
                raise Stop
        return hook

    def passthrough(*args: Any, **kwargs: Any) -> Any:
        h = hidden_arg(args, kwargs)
        return (h,) if returns_tuple else h

    handles = [layer.register_forward_pre_hook(catcher(i), with_kwargs=True)
               for i, layer in enumerate(layers)]
    saved = [layer.__dict__.get("forward") for layer in layers]
    for layer in list(layers)[:-1]:
        layer.forward = passthrough  # instance attribute: shadows the class's forward
    try:
        base(**base_kwargs)
    except Stop:
        pass
    finally:
        for handle in handles:
            handle.remove()
        for layer, fwd in zip(layers, saved):
            if fwd is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = fwd
    missing = [i for i, r in enumerate(records) if r is None]
    if missing:
        raise ChainError(f"{type(base).__name__} did not call decoder layers {missing} of its "
                         f"{n}-layer list: cannot chain a model that skips layers")
    return records  # type: ignore[return-value]


def _walk_tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _walk_tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _walk_tensors(v)


def _embed_parts(base: nn.Module, exclude: set[int]) -> tuple[dict[str, nn.Module],
                                                               list[nn.Parameter]]:
    """Modules and loose parameters of ``base`` outside the layers and the final norm."""
    parts: dict[str, nn.Module] = {}
    loose: list[nn.Parameter] = []

    def visit(module: nn.Module, prefix: str) -> None:
        loose.extend(module.parameters(recurse=False))
        for name, child in module.named_children():
            if id(child) in exclude:
                continue
            if any(id(m) in exclude for m in child.modules()):
                visit(child, prefix + name + ".")
            else:
                parts[prefix + name] = child

    visit(base, "")
    return parts, loose


# ---------------------------------------------------------------------------- the adapter


def hf_chain(model: nn.Module, sample: Any, *, head_chunk_tokens: int = 1024) -> Chain:
    cls = type(model).__name__
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise ChainError(f"{cls} is an encoder-decoder model: only decoder-only causal LMs "
                         "(embeddings -> layers -> norm -> head) can be chained")
    for field, feature in _HEAD_FEATURES.items():
        value = getattr(config, field, None)
        if value is not None and value != 1:
            raise ChainError(f"{cls} uses {feature} ({field}={value}), which the generic causal-LM "
                             "adapter does not support; set it to None/1 or use a model without it")
    loss_type = getattr(model, "loss_type", None)
    if "_loss_function" in model.__dict__ or loss_type not in (None, "ForCausalLM"):
        raise ChainError(f"{cls} uses loss {loss_type!r} (or a custom loss_function); the adapter "
                         "computes the standard shifted causal-LM cross-entropy only")
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ChainError(f"{cls}.get_output_embeddings() is {type(head).__name__}, not nn.Linear: "
                         "the head cannot be fused with the loss")
    base = model.base_model
    if base is model:
        raise ChainError(f"{cls} has no base model (base_model_prefix "
                         f"{getattr(model, 'base_model_prefix', None)!r}): cannot find its layers")
    layers_name, layers = decoder_layers(base)
    owner = base.get_submodule(layers_name.rpartition(".")[0]) if "." in layers_name else base

    signature = inspect.signature(model.forward)
    args, kwargs = call_args(sample)
    x0, ctx0 = _split(signature, args, kwargs, cls)
    input_key = ctx0["input_key"]

    # One small eval run of the real model: call order of the layers' siblings (the final norm
    # is whatever runs after the last layer) and the reference for the verification below.
    tiny = x0[:1, :_VERIFY_TOKENS]
    tiny_kwargs = {input_key: tiny, "use_cache": False}
    order: list[nn.Module] = []
    after_last = [False]
    returns_tuple = [False]

    def sibling_hook(module: nn.Module, args: tuple) -> None:
        if after_last[0] and module not in order:
            order.append(module)

    def last_hook(module: nn.Module, args: tuple, output: Any) -> None:
        after_last[0] = True
        returns_tuple[0] = isinstance(output, tuple)

    handles = [child.register_forward_pre_hook(sibling_hook)
               for child in owner.children() if child is not layers]
    handles.append(layers[-1].register_forward_hook(last_hook))
    try:
        with torch.no_grad(), _mode(model, False):
            reference = model(**tiny_kwargs)
    finally:
        for handle in handles:
            handle.remove()
    post = order

    # Random numbers drawn by the decoder loop itself (LayerDrop) cannot be replayed per stage.
    rng_states: list[torch.Tensor] = []
    with torch.no_grad(), torch.random.fork_rng(devices=_rng_devices(tiny)), _mode(model, True):
        _layer_inputs(base, layers, tiny_kwargs, returns_tuple[0], rng_states)
    if any(not torch.equal(rng_states[0], s) for s in rng_states[1:]):
        raise ChainError(f"{type(base).__name__} draws random numbers between decoder layers "
                         "(e.g. LayerDrop) in training mode: not supported by the chain adapter")
    exclude = {id(layers)} | {id(m) for m in post}
    parts, loose = _embed_parts(base, exclude)
    embed = EmbedStage(base, layers[0], input_key, parts, loose)
    layer_stages = [LayerStage(layer, i) for i, layer in enumerate(layers)]
    head_stage = HeadStage(post, head, head_chunk_tokens)
    stages: list[nn.Module] = [embed, *layer_stages, head_stage]
    names = ["embed", *[f"layers.{i}" for i in range(len(layers))], "head"]

    def split_inputs(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, Context]:
        x, ctx = _split(signature, args, kwargs, cls)
        with torch.no_grad(), torch.random.fork_rng(devices=_rng_devices(x)):
            ctx["layer_inputs"] = _layer_inputs(base, layers, {**ctx["base_kwargs"], input_key: x},
                                                returns_tuple[0])
        return x, ctx

    def wrap_output(x: torch.Tensor, ctx: Context) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        if ctx.get("labels") is None:
            return CausalLMOutputWithPast(loss=None, logits=x)
        return CausalLMOutputWithPast(loss=x, logits=None)

    chain = Chain(stages=stages, names=names,
                  signatures=[module_signature(s) for s in stages],
                  split_inputs=split_inputs, wrap_output=wrap_output)
    _verify(model, chain, input_key, tiny, reference.logits)
    # Side inputs must not need gradients: split_inputs computes them without grad. Last:
    # a model on a disk tier keeps the weights this run fetches with grad on (the embedding)
    # until the caller's fetching ends, and the verification's head beside them would take
    # both at once
    with torch.enable_grad(), _mode(model, False):
        records = _layer_inputs(base, layers, tiny_kwargs, returns_tuple[0])
    if any(t.requires_grad for t in _walk_tensors(records)):
        raise ChainError(f"{type(base).__name__} passes its decoder layers inputs that depend on "
                         "parameters (other than the hidden states): not supported")
    return chain


def _split(signature: inspect.Signature, args: tuple, kwargs: dict, cls: str
           ) -> tuple[torch.Tensor, Context]:
    """The causal-LM call arguments -> (input_ids or inputs_embeds, ctx without layer inputs)."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{cls} cannot be called with these arguments: {e}") from None
    arguments: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(value)
        else:
            arguments[name] = value
    arguments = {k: v for k, v in arguments.items() if v is not None}
    if arguments.get("past_key_values") is not None:
        raise ChainError(f"{cls}: past_key_values (a KV cache) is not supported in a chain; "
                         "call it without a cache for training")
    for flag in ("output_attentions", "output_hidden_states"):
        if arguments.get(flag):
            raise ChainError(f"{cls}: {flag}=True is not supported in a chain; leave it unset")
    if arguments.get("logits_to_keep", 0) not in (0, None):
        raise ChainError(f"{cls}: logits_to_keep={arguments['logits_to_keep']} is not supported "
                         "in a chain; leave it at 0 (all positions)")
    if arguments.get("return_dict") is False:
        raise ChainError(f"{cls}: return_dict=False is not supported in a chain; leave it unset")
    labels, shift_labels = arguments.get("labels"), arguments.get("shift_labels")
    ctx: Context = {
        "labels": shift_labels if shift_labels is not None else labels,
        "shift": shift_labels is None,
        "num_items_in_batch": arguments.get("num_items_in_batch"),
    }
    base_kwargs = {k: v for k, v in arguments.items() if k not in _HEAD_ARGS}
    base_kwargs["use_cache"] = False
    for key in ("input_ids", "inputs_embeds"):
        if key in base_kwargs:
            x = base_kwargs.pop(key)
            ctx.update(input_key=key, base_kwargs=base_kwargs)
            return x, ctx
    raise TypeError(f"{cls} needs input_ids or inputs_embeds, got {sorted(arguments)}")


def _verify(model: nn.Module, chain: Chain, input_key: str, tiny: torch.Tensor,
            reference: torch.Tensor) -> None:
    cls = type(model).__name__
    with torch.no_grad(), _mode(model, False):
        got = chain.run(**{input_key: tiny}).logits
        try:
            torch.testing.assert_close(got, reference)
        except AssertionError:
            diff = (got.float() - reference.float()).abs().max().item()
            raise ChainError(
                f"{cls}: the chained logits differ from the model's by up to {diff:.3g}: its "
                "forward does something between the layers or in the head that the generic "
                "causal-LM adapter does not reproduce; it cannot be chained") from None
        if input_key != "input_ids":
            return
        ref_loss = model(input_ids=tiny, labels=tiny, use_cache=False).loss
        loss = chain.run(input_ids=tiny, labels=tiny).loss
        if not torch.allclose(loss.float(), ref_loss.float(), rtol=1e-3, atol=1e-3):
            raise ChainError(f"{cls}: the chained loss {loss.item():.6g} differs from the model's "
                             f"{ref_loss.item():.6g}: its loss is not the standard shifted "
                             "causal-LM cross-entropy; it cannot be chained")
