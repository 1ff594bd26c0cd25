"""``--freeze`` and ``--train-only``: partial fine-tuning, applied to a built model as a
function (``tierflow train`` and the simulator's ``tierflow plan`` match the same patterns).

Both take comma-separated glob patterns (``fnmatch``: ``*``, ``?``, ``[0-9]``) over the
parameter names ``model.named_parameters()`` gives, e.g. ``model.embed_tokens.weight`` or
``model.layers.3.mlp.up_proj.weight``. ``--train-only`` freezes every parameter that matches
none of its patterns; ``--freeze`` then freezes those that match one of its. A tied
parameter (an LM head sharing the input embedding) answers to both of its names.

A frozen parameter gets ``requires_grad_(False)``, which is all ``tierflow.fit`` needs: the
planner prices it as a weight that is read and never written back, gives it no gradient and
no optimizer state, and runs the stages before the first one that trains forward only
(``plan/forward_only.py``). Each pattern must match a parameter, so that a typo is an error
and not a silently different run.
"""
from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

from ..core.errors import TierflowError

if TYPE_CHECKING:
    from torch import nn


def split_patterns(flag: str, value: str | None) -> list[str]:
    """The parameter-name globs of ``--freeze`` or ``--train-only`` (comma-separated); one
    line naming ``flag`` if one is empty."""
    if value is None:
        return []
    give = "give comma-separated parameter-name globs, e.g. 'model.embed_tokens.*,model.layers.0.*'"
    if not isinstance(value, str):
        raise TierflowError(f"{flag} {value!r} is not text: {give}")
    patterns = [p.strip() for p in value.split(",")]
    if not all(patterns):
        raise TierflowError(f"{flag} {value!r} has an empty pattern: {give}")
    return patterns


@dataclass(frozen=True)
class Frozen:
    """What ``freeze_parameters`` did: parameters (tied ones once) and their elements."""
    frozen: int
    total: int
    frozen_numel: int
    total_numel: int


def freeze_parameters(model: nn.Module, freeze: str | None, train_only: str | None) -> Frozen:
    """Freeze the parameters of ``model`` that ``--train-only`` leaves out or ``--freeze``
    names; returns the counts. Refuses a pattern that matches nothing, and a selection
    that leaves nothing to train."""
    names, params = _named(model)
    keep = _matches("--train-only", split_patterns("--train-only", train_only), names)
    drop = _matches("--freeze", split_patterns("--freeze", freeze), names)
    frozen = set(drop)
    if train_only is not None:
        frozen |= set(names) - keep
    if frozen and all(key in frozen or not params[key].requires_grad for key in params):
        given = " and ".join(f"{flag} {value!r}" for flag, value in
                             (("--train-only", train_only), ("--freeze", freeze)) if value)
        raise TierflowError(f"{given} freezes all {len(params)} parameters: nothing would "
                            "train; leave some out of --freeze (or name them in --train-only)")
    for key in frozen:
        params[key].requires_grad_(False)
    return Frozen(frozen=len(frozen), total=len(params),
                  frozen_numel=sum(params[k].numel() for k in frozen),
                  total_numel=sum(p.numel() for p in params.values()))


def _matches(flag: str, patterns: list[str], names: dict[int, list[str]]) -> set[int]:
    """The ids of the parameters one of whose names matches one of ``patterns``."""
    found: set[int] = set()
    for pattern in patterns:
        hit = {key for key, aliases in names.items()
               if any(fnmatchcase(n, pattern) for n in aliases)}
        if not hit:
            examples = ", ".join(_examples(names))
            raise TierflowError(f"{flag} pattern {pattern!r} matches no parameter: names look "
                                f"like {examples} (globs: * ? [0-9])")
        found |= hit
    return found


def _examples(names: dict[int, list[str]], n: int = 4) -> list[str]:
    """A few parameter names: the first ones and the last (the head), as a hint."""
    flat = [aliases[0] for aliases in names.values()]
    return flat[:n - 1] + flat[-1:] if len(flat) > n else flat


def tied_frozen(model: nn.Module) -> list[tuple[str, ...]]:
    """The names of each frozen parameter that has several (a tied embedding and LM head):
    freezing it under one name froze it under the others too."""
    names, params = _named(model)
    return [tuple(aliases) for key, aliases in names.items()
            if not params[key].requires_grad and len(aliases) > 1]


def _named(model: nn.Module) -> tuple[dict[int, list[str]], dict[int, nn.Parameter]]:
    """id(parameter) -> every name it has (a tied one: several), and -> the parameter."""
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    return names, params
