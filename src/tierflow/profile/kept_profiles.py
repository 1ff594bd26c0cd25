"""The measurements a run of ``tierflow train`` planned on, kept in the user's cache
(``machine.cache_dir``) per run configuration, for ``tierflow plan --measure`` to plan on.

Two processes never measure a model alike: a few MiB of a stage's transient, a few percent of
its time. Where two placements are within that of each other (W2 at 4 GiB on a 2-core Zen 3:
every activation kept, or the first stage recomputed, 0.3% apart), a plan re-measured in
another process can tip to the other one. Planned on the trainer's own measurements, with the
trainer's budget and config, the search makes the trainer's plan (``plan/measured.py``).

One JSON file per configuration, named by a digest of what the measurements depend on
(``profile_key``): the model's architecture, the micro-batch, the sequence, the precision, the RAM
budget (the profile runs under it), whether a disk tier holds the model, the machine (CPU,
threads, torch) and tierflow's version. Never pickled; a file that does not parse is ignored.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.files import write_text_atomically
from ..plan.measured import Measured
from .machine import cache_dir, machine_key

KEPT_DIR = "profiles"


@dataclass(frozen=True)
class RunShape:
    """What a run's measurements depend on besides the machine: ``model``, the architecture
    (``sim.shapes.ModelShape`` as a dict, its name left out), the sequences per micro-batch and
    their tokens, the precision (``PrecisionConfig.to_dict``), the RAM budget in bytes (None:
    none), whether a disk tier holds the model, whether the rows pack several documents (a
    masked sample) and whether the stages were compiled."""

    model: dict[str, Any]
    batch: int
    seq: int
    precision: dict[str, Any]
    ram: int | None
    disk: bool
    packed: bool = False
    compiled: bool = False


@dataclass(frozen=True)
class KeptProfile:
    """A kept ``Measured`` and when it was measured (an ISO date)."""

    measured: Measured
    date: str
    path: Path


def profile_key(shape: RunShape) -> str:
    """The digest that names ``shape``'s file."""
    from .. import __version__
    facts = {"model": shape.model, "batch": shape.batch, "seq": shape.seq,
             "precision": shape.precision, "ram": shape.ram, "disk": shape.disk,
             "packed": shape.packed, "compiled": shape.compiled, "machine": machine_key(),
             "tierflow": __version__}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:24]


def keep_profile(shape: RunShape, measured: Measured) -> Path:
    """Write ``measured`` for ``shape`` (replacing what was kept for it); its path."""
    path = _path(shape)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"date": dt.date.today().isoformat(), "measured": measured.to_dict()}
    write_text_atomically(path, json.dumps(record) + "\n")
    return path


def kept_profile(shape: RunShape) -> KeptProfile | None:
    """What ``keep_profile`` kept for ``shape``, or None (nothing kept, or not a record)."""
    path = _path(shape)
    try:
        record = json.loads(path.read_text())
        return KeptProfile(Measured.from_dict(record["measured"]), str(record["date"]), path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def forget_profiles() -> None:
    """Remove every kept profile (``tierflow calibrate``: the next runs measure anew)."""
    for path in (cache_dir() / KEPT_DIR).glob("*.json"):
        path.unlink(missing_ok=True)


def _path(shape: RunShape) -> Path:
    return cache_dir() / KEPT_DIR / f"{profile_key(shape)}.json"
