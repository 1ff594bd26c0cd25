"""What a plan keeps of some stages on a lower tier and moves to and from the compute tier:
optimizer states (``plan/state_schedule.py``), tapes (``plan/tape_schedule.py``), stashed
checkpoints (``plan/boundary_schedule.py``). Pure data; the schedules place its Loads and
Stores among the ops. (Streamed weights carry more: ``weight_schedule.StreamedWeights``.)
"""
from __future__ import annotations

from dataclasses import dataclass

from .ops import Load, Store


@dataclass(frozen=True)
class KeptBelow:
    """Per stage (a checkpoint x[a]: per index), the bytes of its ``what`` that live on the
    lower tier ``home`` (``sizes``: (stage, bytes)), moved from and to the ``compute`` tier
    on the resources ``read`` and ``write``, read ahead of its use or when it is needed."""

    what: str
    sizes: tuple[tuple[int, int], ...]
    home: str
    compute: str
    read: str
    write: str
    read_ahead: bool

    @property
    def stages(self) -> dict[int, int]:
        return dict(self.sizes)

    def load(self, i: int, after_store: bool = False) -> Load:
        return Load(self.what, i, self.home, self.compute, self.read, self.stages[i],
                    after_store)

    def store(self, i: int) -> Store:
        return Store(self.what, i, self.compute, self.home, self.write, self.stages[i])

    def to_dict(self) -> dict:
        return {"what": self.what, "sizes": [list(pair) for pair in self.sizes],
                "home": self.home, "compute": self.compute, "read": self.read,
                "write": self.write, "read_ahead": self.read_ahead}

    @classmethod
    def from_dict(cls, data: dict) -> "KeptBelow":
        return cls(what=data["what"], sizes=tuple((int(i), int(n)) for i, n in data["sizes"]),
                   home=data["home"], compute=data["compute"], read=data["read"],
                   write=data["write"], read_ahead=bool(data["read_ahead"]))
