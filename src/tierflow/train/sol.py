"""Speed of light: the FLOPs a training step needs, so that the trainer can print SOL % =
achieved model FLOP/s over this machine's peak matmul rate
(``profile/machine.peak_matmul_flops``)."""
from __future__ import annotations


def model_flops_per_token(model, seq_len: int) -> float:
    """Training FLOPs per token of the parameters used in matmuls (the input embedding is a
    lookup; a tied head counts once, as the head) and of attention. Per matmul parameter: 2
    forward, 2 for the gradient of its input when anything before it trains, 2 for its own
    gradient when it trains. Attention, per layer: 4 x width x seq forward, 8 backward when
    the layer backpropagates. With every parameter trainable: 6 x parameters + 12 x layers x
    width x seq. Frozen parameters (``--freeze``) count what plain autograd computes."""
    from ..chain.hf import decoder_layers

    config = model.config
    emb = model.get_input_embeddings()
    out = model.get_output_embeddings()
    tied = emb is not None and out is not None and out.weight is emb.weight
    lookup = emb.weight if emb is not None and not tied else None
    layers = decoder_layers(getattr(model, "base_model", model))[1]
    first_param_of_layer = {id(next(layer.parameters())): i for i, layer in enumerate(layers)}
    order = list({id(p): p for p in model.parameters()}.values())  # tied ones once
    if tied:  # computed last, as the head; its lookup feeds the first layer
        order = [p for p in order if p is not emb.weight] + [emb.weight]
    backprop = tied and emb.weight.requires_grad  # whether anything computed before trains
    total = 0.0
    layers_backprop = 0
    for p in order:
        if id(p) in first_param_of_layer and (backprop or any(
                q.requires_grad for q in layers[first_param_of_layer[id(p)]].parameters())):
            layers_backprop += 1
        backprop = backprop or p.requires_grad
        if p is lookup:
            continue
        total += p.numel() * (2 + 2 * backprop + 2 * p.requires_grad)
    width = getattr(config, "hidden_size", None) or getattr(config, "n_embd", 0)
    return total + (4.0 * len(layers) + 8.0 * layers_backprop) * width * seq_len
