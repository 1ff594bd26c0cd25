"""Which parameters train, per chain stage: the simulator's view of ``--freeze``/``--train-only``.

Pure data (no torch). A partial fine-tune changes a prediction in four ways, each priced
where the trainer prices it: frozen weights take no gradient and no optimizer state (their
bytes are ``StageCost.frozen_bytes``); the stages before the first one that trains run
forward only, with no tape and no backward (``plan/forward_only.py``); a frozen matmul
weight costs no weight-gradient FLOPs; and the gradient of a stage's input is computed only
when something before it trains.

``sim/freeze.py`` builds a ``Selection`` from glob patterns over the real parameter names;
``Selection.everything`` is the full training every prediction assumed before.
"""
from __future__ import annotations

from dataclasses import dataclass

from .shapes import ModelShape


@dataclass(frozen=True)
class Selection:
    """Per chain stage (embeddings, each decoder layer, final norm + head), in elements.

    ``trainable[i]``: the parameters stage i owns that train; the embedding matrix an LM
    head shares is counted in neither stage but in ``tied``. ``matmul[i]``: of those, the
    weights that feed matmuls (an embedding is a lookup: none in stage 0; the head's is its
    output projection). ``largest[i]``: the largest trainable parameter stage i uses (the
    optimizer works through it in one piece). ``tied``: elements of the shared embedding
    when it trains, else 0. ``given``: the flags that chose it, for reports ("" when
    everything trains)."""

    trainable: tuple[int, ...]
    matmul: tuple[int, ...]
    largest: tuple[int, ...]
    tied: int = 0
    given: str = ""

    @classmethod
    def everything(cls, shape: ModelShape) -> Selection:
        """Full training: every parameter of ``shape`` trains."""
        tied = shape.vocab * shape.hidden if shape.tied else 0
        vocab_matrix = shape.vocab * shape.hidden
        layer_matrix = shape.largest_layer_matrix()
        return cls(trainable=(shape.embed_params() - tied, *[shape.layer_params()] * shape.layers,
                              shape.head_params()),
                   matmul=(0, *[shape.layer_matmul_params()] * shape.layers,
                           0 if shape.tied else vocab_matrix),
                   largest=(vocab_matrix, *[layer_matrix] * shape.layers, vocab_matrix),
                   tied=tied)

    @property
    def total(self) -> int:
        """Parameters that train, a tied one once."""
        return sum(self.trainable) + self.tied

    @property
    def head_weight_trains(self) -> bool:
        """Whether the LM head's projection takes a gradient (its own, or the tied one)."""
        return self.matmul[-1] > 0 or self.tied > 0

    def needs_backward(self, i: int) -> bool:
        """Whether stage i has a backward: something in it or before it trains (the tied
        embedding trains in stage 0's lookup too). The last stage always has one."""
        return self.tied > 0 or any(self.trainable[:i + 1]) or i == len(self.trainable) - 1

    def input_grad(self, i: int) -> bool:
        """Whether stage i's backward computes the gradient of its input x[i]: something
        before it trains."""
        return i > 0 and (self.tied > 0 or any(self.trainable[:i]))

    def forward_only(self) -> int:
        """How many stages at the front run forward only."""
        return next(i for i in range(len(self.trainable)) if self.needs_backward(i))

    def states(self) -> tuple[int, ...]:
        """Per stage, the parameters whose gradients and optimizer states it holds: the
        tied embedding's with stage 0, whose lookup it is."""
        return (self.trainable[0] + self.tied, *self.trainable[1:])
