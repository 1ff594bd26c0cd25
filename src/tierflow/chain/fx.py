"""Any ``torch.fx``-traceable model as a chain, cut at articulation points.

The model's first argument is the chain input x0; its other arguments go to ctx by name. A node
of the traced graph is a *cut* when every path from x0 to the output passes through it and its
value is one tensor. With the nodes in graph (topological) order, and looking only at the nodes
that depend on x0, that is exactly: no edge jumps over it (from a node before it to a node after
it). A cut whose value a consumer modifies in place (``relu(inplace=True)``, ``add_``) is
skipped: the next stage would overwrite the previous stage's output.

The segments between cuts are then merged so that a stage is not one cheap op: a segment that
uses no Parameters, or only normalisation layers' (BatchNorm, LayerNorm, ...), joins the stage
before it (segments before the first one with weights join that one). Only the segment's own
ops count here, not the x0-independent ones it recomputes.

Each stage is an ``fx.GraphModule`` with ``forward(x, ctx)``, built over the original model, so
it holds the original modules and Parameters. Nodes that do not depend on x0 (weights read with
``get_attr``, computations on other arguments) are copied into every stage that uses them and
recomputed there; model arguments other than x0 are read as ``ctx[name]``. The last stage
returns whatever the model returns (a tensor, or a tuple/dict of them).

Tracing fixes Python-level reads of ``self.training`` (``F.dropout(x, p, self.training)``):
the model is traced in both modes and, when the graphs differ, the stages refuse to run in the
other mode. BatchNorm in training mode updates its running statistics on every forward, a
recompute included: see ``base.stateful_modules``.
"""
from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
from torch import fx, nn

from .base import Chain, ChainError, Context, call_args

_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm,
          getattr(nn, "RMSNorm", nn.LayerNorm))
_INPLACE_OPS = {operator.iadd, operator.isub, operator.imul, operator.itruediv,
                operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
                operator.ixor, operator.ilshift, operator.irshift, operator.imatmul}


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _mutates_first_arg(node: fx.Node, model: nn.Module) -> bool:
    if node.op == "call_module":
        return bool(getattr(model.get_submodule(node.target), "inplace", False))
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        return (node.target in _INPLACE_OPS or node.kwargs.get("inplace") is True
                or (name.endswith("_") and not name.endswith("__")))
    return False


def _observe_tensors(gm: fx.GraphModule, model: nn.Module, inputs: list[Any]) -> set[fx.Node]:
    """Run the graph once on the sample (no grad, RNG and buffers restored); the nodes whose
    value is a single tensor."""
    tensors: set[fx.Node] = set()

    class Observer(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            value = super().run_node(n)
            if isinstance(value, torch.Tensor):
                tensors.add(n)
            return value

    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({t.device for t in inputs if isinstance(t, torch.Tensor) and t.is_cuda},
                     key=str)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            Observer(gm).run(*inputs)
    except Exception as e:
        raise ChainError(f"{type(model).__name__}: running its traced graph on the sample failed "
                         f"({_first_line(e)}); check the sample") from None
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    return tensors


def _uses_weights(nodes: list[fx.Node], model: nn.Module) -> bool:
    """Whether ``nodes`` use Parameters other than normalisation layers'."""
    for n in nodes:
        if n.op == "call_module":
            mod = model.get_submodule(n.target)
            if any(True for _ in mod.parameters()) and not isinstance(mod, _NORMS):
                return True
        elif n.op == "get_attr":
            if isinstance(_getattr_path(model, n.target), nn.Parameter):
                return True
    return False


def _getattr_path(model: nn.Module, target: str) -> Any:
    obj: Any = model
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _stage_graph(start: fx.Node, members: list[fx.Node],
                 end: fx.Node | None) -> fx.Graph:
    """A graph forward(x, ctx): ``start``'s value is x; runs ``members`` (in order) plus the
    x0-independent nodes they need; returns ``end``'s value (None: the model's output)."""
    g = fx.Graph()
    x = g.placeholder("x")
    ctx = g.placeholder("ctx")
    env: dict[fx.Node, fx.Node] = {start: x}

    def get(n: fx.Node) -> fx.Node:
        if n not in env:  # does not depend on x0: recompute it here
            if n.op == "placeholder":
                env[n] = g.call_function(operator.getitem, (ctx, n.target))
            else:
                env[n] = g.node_copy(n, get)
        return env[n]

    for n in members:
        if n.op == "output":
            g.output(fx.map_arg(n.args[0], get))
        else:
            env[n] = g.node_copy(n, get)
    if end is not None:
        g.output(env[end])
    g.lint()
    return g


def _signature(g: fx.Graph, model: nn.Module) -> str:
    """Equal for stages that run the same ops on modules/weights of the same kind and shapes,
    whatever their names in the model."""
    index = {n: i for i, n in enumerate(g.nodes)}
    parts = []
    for n in g.nodes:
        if n.op == "call_module":
            mod = model.get_submodule(n.target)
            target = repr(mod) + "|" + ";".join(f"{tuple(p.shape)}:{p.dtype}:{p.requires_grad}"
                                                 for p in mod.parameters())
        elif n.op == "get_attr":
            value = _getattr_path(model, n.target)
            target = (f"{type(value).__name__}:{tuple(value.shape)}:{value.dtype}"
                      if isinstance(value, torch.Tensor) else repr(value))
        elif n.op == "call_function":
            target = f"{getattr(n.target, '__module__', '')}.{getattr(n.target, '__name__', n.target)}"
        else:
            target = str(n.target) if n.op != "placeholder" else ""
        args = fx.map_arg((n.args, n.kwargs), lambda a: f"%{index[a]}")
        parts.append(f"{n.op}:{target}:{args}")
    return "fx|" + "\n".join(parts)


def _stage_name(g: fx.Graph, model: nn.Module, k: int) -> str:
    """The modules with weights that the stage calls: their common path, else first..last."""
    paths = []
    for n in g.nodes:
        if n.op == "call_module" and any(True for _ in model.get_submodule(n.target).parameters()):
            paths.append(n.target)
        elif n.op == "get_attr" and isinstance(_getattr_path(model, n.target), nn.Parameter):
            paths.append(n.target.rpartition(".")[0] or n.target)
    if not paths:
        return f"ops.{k}"
    split = [p.split(".") for p in paths]
    common: list[str] = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common) if common else f"{paths[0]}..{paths[-1]}"


def fx_chain(model: nn.Module, sample: Any) -> Chain:
    cls = type(model).__name__
    training = model.training
    try:
        gm = fx.symbolic_trace(model)
        # A forward that reads self.training (F.dropout(x, p, self.training)) is traced with
        # the flag's current value baked in: trace the other mode too to find out.
        flags = [(m, m.training) for m in model.modules()]
        model.train(not training)
        try:
            mode_dependent = fx.symbolic_trace(model).code != gm.code
        finally:
            for m, flag in flags:
                m.training = flag
    except Exception as e:
        raise ChainError(f"{cls} cannot be traced by torch.fx ({_first_line(e)}); make it an "
                         "nn.Sequential, remove data-dependent control flow, or chain a traceable "
                         "sub-module") from None
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if not placeholders:
        raise ChainError(f"{cls}.forward takes no input: nothing to chain")
    x0_node = placeholders[0]
    signature = inspect.signature(model.forward)

    def bind(args: tuple, kwargs: dict) -> dict[str, Any]:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{cls} cannot be called with these arguments: {e}") from None
        bound.apply_defaults()
        return dict(bound.arguments)

    args, kwargs = call_args(sample)
    values = bind(args, kwargs)
    inputs = [values[p.target] for p in placeholders]
    tensors = _observe_tensors(gm, model, inputs)

    # Nodes that depend on x0, in order; a cut has no edge jumping over it.
    pos = {n: i for i, n in enumerate(nodes)}
    dependent: set[fx.Node] = {x0_node}
    for n in nodes:
        if any(a in dependent for a in n.all_input_nodes):
            dependent.add(n)
    output = nodes[-1]
    cuts: list[fx.Node] = []
    reach = pos[x0_node]  # the furthest position an edge from an earlier node reaches
    for n in nodes:
        if n not in dependent or n is output:
            continue
        if (n is not x0_node and reach <= pos[n] and n in tensors
                and not any(u.args and u.args[0] is n and _mutates_first_arg(u, model)
                            for u in n.users)):
            cuts.append(n)
        reach = max([reach] + [pos[u] for u in n.users if u in dependent])
    if cuts and all(n is output for n in nodes[pos[cuts[-1]] + 1:] if n in dependent):
        cuts.pop()  # the model just returns it: the last stage would be empty
    if not cuts:
        raise ChainError(f"{cls} has no articulation point (no single tensor that every path "
                         "from the input to the output goes through): it cannot be cut into a "
                         "chain; restructure it as an nn.Sequential of blocks")

    # Segments between cuts; cheap ones (no weights, or only norms) join the previous stage.
    bounds = [x0_node, *cuts, output]
    segments = [[n for n in nodes if n in dependent and pos[a] < pos[n] <= pos[b]]
                for a, b in zip(bounds, bounds[1:])]

    def own_weights(seg: list[fx.Node]) -> list[fx.Node]:  # the segment and weights it reads
        return seg + [a for n in seg for a in n.all_input_nodes if a.op == "get_attr"]

    groups: list[int] = []  # index of the last segment of each stage
    heavy_seen = False
    for i, seg in enumerate(segments):
        heavy = _uses_weights(own_weights(seg), model)
        if groups and (not heavy or not heavy_seen):
            groups[-1] = i  # join the stage before (leading light segments: the first heavy one)
        else:
            groups.append(i)
        heavy_seen = heavy_seen or heavy

    stages: list[nn.Module] = []
    names: list[str] = []
    signatures: list[str] = []
    first = 0
    for k, last in enumerate(groups):
        members = [n for s in segments[first:last + 1] for n in s]
        start = bounds[first]
        end = None if last == len(segments) - 1 else bounds[last + 1]
        g = _stage_graph(start, members, end)
        stage = fx.GraphModule(model, g, class_name=f"{cls}Stage")
        stages.append(stage)
        names.append(_stage_name(g, model, k))
        signatures.append(_signature(g, model))
        first = last + 1
    seen: dict[str, int] = {}
    for i, name in enumerate(names):  # unique names
        if name in seen:
            names[i] = f"{name}#{i}"
        seen[name] = i

    if mode_dependent:
        mode = "train" if training else "eval"

        def same_mode(stage: nn.Module, args: Any) -> None:
            if model.training != training:
                raise ChainError(f"{cls} was chained in {mode} mode and its forward reads "
                                 "self.training, which tracing fixed: call to_chain again after "
                                 "model.train() / model.eval()")

        for stage in stages:
            stage.register_forward_pre_hook(same_mode)

    side = [p.target for p in placeholders[1:]]

    def split_inputs(*args: Any, **kwargs: Any) -> tuple[Any, Context]:
        values = bind(args, kwargs)
        return values[x0_node.target], {name: values[name] for name in side}

    return Chain(stages=stages, names=names, signatures=signatures,
                 split_inputs=split_inputs, wrap_output=lambda x, ctx: x)
