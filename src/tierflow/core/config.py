"""The planner choice and its settings: a typed config that saves and loads as JSON.

``FitConfig.generate("rotor")`` gives the defaults of one planner; edit it, ``save`` it,
``load`` it and pass it as ``tierflow.fit(model, sample, config=...)``. No torch here.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

PLANNERS = ("auto", "keep-all", "checkpoint-all", "rotor")
STREAMING = ("auto", "never", "all")
STATES_TIERS = ("auto", "compute", "ram", "disk")
# the global gradient norm ``tierflow train`` clips to unless told (``--clip``), and so what
# ``tierflow plan`` and ``sweep`` predict: clipping moves the updates after the backward
DEFAULT_CLIP = 1.0
# the largest segment of page-locked host RAM the copies below a GPU are carved from
# (``exec/pinned.py``); the last one's unused end, at most this, is RAM no plan can use
PINNED_SEGMENT_BYTES = 1 << 30


@dataclass(frozen=True)
class FitConfig:
    planner: str = "auto"  # auto: keep-all when it fits the budget, else rotor
    rotor_slots: int = 500  # memory is discretised into this many units for rotor
    profile_repeats: int = 2  # timed rounds per distinct stage, after one warm-up round
    # ... and more (at most 8) until the timed rounds took this many seconds: their median
    # is the stage's time (one round's moves by a quarter on a shared 2-core machine)
    profile_seconds: float = 4.0
    head_chunk_tokens: int | None = None  # tokens per chunk of the fused LM head + loss; None: auto
    headroom: float = 0.0  # fraction of the budget kept free for what tierflow cannot see
    compile: bool = False  # torch.compile stages that share a kernel (decoder layers), once
    stream: str = "auto"  # stage weights on a lower tier: when needed / never / every stage
    prefetch_depth: int | None = None  # stages read ahead of use (0: on demand); None: chosen
    # run the plan (made for its prefetch depth) with every read on demand: what reading
    # ahead saves is the difference (the overlap benchmark's ablation)
    serial_reads: bool = False
    simulated_gpu: bool = False  # a CPU model planned as on a GPU of fit(gpu=), RAM below
    offload_tapes: str = "auto"  # tapes on the lower tier, not recomputed: auto/never/all
    # checkpoints on the lower tier while unneeded (offload beside recompute): auto/never/all
    stash_boundaries: str = "auto"
    # the optimizer steps in host RAM, where its states live, the stages whose weights stream
    # from there (below a GPU, real or simulated): auto/never/all
    host_updates: str = "auto"
    # where the owned optimizer's states live: the planner's choice (auto), the compute tier,
    # the host RAM below a GPU (ZeRO-Offload's CPU offload) or the disk tier (NVMe offload)
    optimizer_states: str = "auto"
    # taped forwards keep only their matmul and attention outputs and the backward recomputes
    # the rest (exec/selective.py), where the planner finds it faster: auto/never/all
    selective: str = "auto"
    # the kernel holds the process to the RAM budget: a memory cgroup (v2, else v1) entered
    # once the step is planned, page cache counted, no swap (``tierflow/exec/enforce.py``)
    enforce: bool = False
    # with enforce: where no cgroup can be made, say why and run on unenforced (else an error)
    unenforced_ok: bool = False

    def __post_init__(self) -> None:
        for name, allowed in (("planner", PLANNERS), ("stream", STREAMING),
                              ("offload_tapes", STREAMING), ("stash_boundaries", STREAMING),
                              ("host_updates", STREAMING), ("selective", STREAMING),
                              ("optimizer_states", STATES_TIERS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} {getattr(self, name)!r} is unknown: use one of "
                                 f"{', '.join(allowed)}")
        if self.rotor_slots < 10:
            raise ValueError(f"rotor_slots={self.rotor_slots} is too coarse: use at least 10")
        if self.profile_repeats < 1:
            raise ValueError(f"profile_repeats={self.profile_repeats} must be at least 1")
        if self.profile_seconds < 0:
            raise ValueError(f"profile_seconds={self.profile_seconds} must be at least 0")
        if self.head_chunk_tokens is not None and self.head_chunk_tokens < 1:
            raise ValueError(f"head_chunk_tokens={self.head_chunk_tokens} must be at least 1")
        if self.optimizer_states == "compute" and self.stream == "all":
            raise ValueError("stream='all' keeps the optimizer states below the compute tier, "
                             "beside the streamed weights: optimizer_states='compute' "
                             "contradicts it; use stream='auto', or another states tier")
        if self.prefetch_depth is not None and self.prefetch_depth < 0:
            raise ValueError(f"prefetch_depth={self.prefetch_depth} must be at least 0")
        if self.unenforced_ok and not self.enforce:
            raise ValueError("unenforced_ok=True only matters with enforce=True: give both")
        if not 0.0 <= self.headroom < 1.0:
            raise ValueError(f"headroom={self.headroom} must be in [0, 1)")

    @classmethod
    def generate(cls, planner: str = "auto") -> "FitConfig":
        """The default settings of one planner."""
        return cls(planner=planner)

    def to_json(self) -> str:
        """These settings as JSON (``from_json`` reads it back)."""
        return json.dumps({"format": "tierflow-fit-config", **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "FitConfig":
        """The settings ``to_json`` wrote; an error for another format or an unknown key."""
        data = json.loads(text)
        if data.pop("format", None) != "tierflow-fit-config":
            raise ValueError("not a tierflow fit config (missing format: tierflow-fit-config)")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown fit config keys {unknown}: known keys are {sorted(known)}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        """Write ``to_json()`` to ``path``."""
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "FitConfig":
        """The settings ``save`` wrote to ``path``."""
        return cls.from_json(Path(path).read_text())
