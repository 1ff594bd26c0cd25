"""Hold this process to a memory limit with a cgroup, so that the kernel, not a measurement
after the fact, keeps a RAM budget (``tierflow train --enforce``, ``FitConfig(enforce=True)``).

The process moves itself into a new cgroup made below its own (so that every limit above it
still applies) and the cgroup's limit counts its anonymous memory and the page cache of the
files it reads and writes, with swap off: cgroup v2's ``memory.max`` (``memory.swap.max``
0) where v2's memory controller is mounted, cgroup v1's ``memory.limit_in_bytes`` (and
``memory.memsw.limit_in_bytes`` at the same value) where only v1's is.

Neither version moves the charges of pages the process already holds (v1 can, with the
deprecated ``memory.move_charge_at_immigrate``; v2 cannot): what the process holds when it
moves stays charged where it was, and the cgroup counts the pages it faults in from then on.
So a budget of ``budget`` bytes above a baseline RSS, entered when the RSS is ``rss``, is a
limit of ``budget - (rss - baseline)``: the RSS above the baseline is then at most what was
held at the move plus what the cgroup holds (``limit_for``). Pages freed and faulted in
again after the move count in the cgroup while their old charge is gone, so the limit errs on
the strict side by what is freed of the old pages, never on the loose one.

No torch here: the trainer enters the cgroup before the first step (``fit``, after planning);
``tierflow generate`` once its plan is decided, before it reads a weight. Both check their
flags with ``check_flags`` and enter with ``hold``.
"""
from __future__ import annotations

import atexit
import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..core.errors import TierflowError
from ..core.units import format_bytes

CGROUP_MOUNT = Path("/sys/fs/cgroup")
# where cgroup v1's memory controller and a v2 hierarchy beside it are mounted on a hybrid
# system (systemd's "unified" layout, as on the development machines)
V1_MEMORY = CGROUP_MOUNT / "memory"
V2_HYBRID = CGROUP_MOUNT / "unified"
NOTE = "[memory cgroup]"  # how what enforcing said starts, in fit's log and the trainer's


class EnforceError(TierflowError):
    """No memory cgroup can hold this process here; the message says why."""


@dataclass(frozen=True)
class Enforced:
    """A cgroup this process runs in: its ``path``, cgroup ``version`` (1 or 2) and
    ``limit`` in bytes."""
    path: Path
    version: int
    limit: int

    def describe(self) -> str:
        """One line for the run's log."""
        key = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        return (f"{NOTE} enforced by the kernel: cgroup v{self.version} {self.path} ({key} "
                f"{format_bytes(self.limit)}, page cache counted, no swap)")


def limit_for(budget: int, baseline: int, rss: int) -> int:
    """The cgroup limit that holds the RSS above ``baseline`` to ``budget`` when the process
    enters the cgroup at RSS ``rss`` (its pages until then stay charged where they were)."""
    return budget - max(0, rss - baseline)


def check_flags(enforce: bool, unenforced_ok: bool, ram: object, gpu: object = None) -> None:
    """``--enforce`` and ``--unenforced-ok`` as every command reads them: ``--enforce`` holds
    the CPU's ``--ram`` (so it needs one, and no ``--gpu``), ``--unenforced-ok`` only says what
    ``--enforce`` does where no cgroup can be made. One line naming the fix otherwise."""
    if enforce and (ram is None or gpu is not None):
        raise TierflowError("--enforce holds the CPU's --ram budget with a memory cgroup: "
                            "give --ram SIZE" + (" and no --gpu" if gpu is not None else ""))
    if unenforced_ok and not enforce:
        raise TierflowError("--unenforced-ok says what --enforce does where no cgroup can "
                            "be made: give --enforce too")


def hold(budget: int, baseline: int, rss: int, *, unenforced_ok: bool,
         say: Callable[[str], None], name: str = "--ram") -> Enforced | None:
    """Move this process into a memory cgroup that holds its RSS above ``baseline`` to
    ``budget`` bytes, now that it holds ``rss`` (``limit_for``), and ``say`` so (a line
    starting with ``NOTE``). Where no cgroup can be made: an EnforceError naming why, or with
    ``unenforced_ok`` a note saying why and None. A budget the process already holds
    (``name``, the option that gave it) is refused in one line either way: no cgroup can
    keep it."""
    limit = limit_for(budget, baseline, rss)
    if limit <= 0:
        held = rss - baseline
        raise TierflowError(f"{name} {format_bytes(budget)} cannot be enforced: the process "
                            f"already holds {format_bytes(held)} above its post-import "
                            f"baseline, which leaves the memory cgroup a limit of "
                            f"{format_bytes(limit)}: give {name} above "
                            f"{format_bytes(held, round_up=True)}, with room for the run")
    try:
        held_to = enforce(limit)
    except EnforceError as e:
        if not unenforced_ok:
            raise
        say(f"{NOTE} {e}; running unenforced (unenforced_ok)")
        return None
    say(held_to.describe())
    return held_to


def enforce(limit: int, pid: int | None = None) -> Enforced:
    """Move process ``pid`` (this one) into a new memory cgroup of ``limit`` bytes: cgroup v2
    where its memory controller is mounted, else cgroup v1. Raises EnforceError naming why
    neither can be made; the cgroup is removed when the process exits."""
    if limit <= 0:
        raise EnforceError(f"the memory cgroup's limit would be {limit} bytes: the process "
                           "already holds the budget above its baseline; give a larger budget")
    pid = os.getpid() if pid is None else pid
    reasons = []
    for version, parent in ((2, v2_parent(pid)), (1, v1_parent(pid))):
        if isinstance(parent, str):
            reasons.append(parent)
            continue
        try:
            path = (enter_v2 if version == 2 else enter_v1)(parent, limit, pid)
        except OSError as e:
            hint = (": a v2 cgroup that holds processes gives its children no controller; "
                    "run under systemd-run --scope -p MemoryMax=SIZE -p MemorySwapMax=0 "
                    "instead" if version == 2 else "")
            reasons.append(f"cgroup v{version} at {parent} refused it ({e.strerror or e}){hint}")
            continue
        atexit.register(_leave, path, parent)
        return Enforced(path, version, limit)
    raise EnforceError("no memory cgroup can hold this process: " + "; ".join(reasons))


def enter_v2(parent: Path, limit: int, pid: int) -> Path:
    """Make ``parent``/tierflow-PID with ``memory.max`` ``limit`` and ``memory.swap.max`` 0
    (where swap accounting exists) and move ``pid`` into it. The parent must have the memory
    controller enabled for its children (``cgroup.subtree_control``), which v2 allows only
    where the parent holds no process itself (or is the root)."""
    control = parent / "cgroup.subtree_control"
    if "memory" not in control.read_text().split():
        control.write_text("+memory")
    path = _fresh(parent, pid)
    (path / "memory.max").write_text(str(limit))
    swap = path / "memory.swap.max"
    if swap.exists():
        swap.write_text("0")
    (path / "cgroup.procs").write_text(str(pid))
    return path


def enter_v1(parent: Path, limit: int, pid: int) -> Path:
    """Make ``parent``/tierflow-PID with ``memory.limit_in_bytes`` ``limit`` (and
    ``memory.memsw.limit_in_bytes``, memory and swap together, at the same value: no swap,
    where swap accounting exists) and move ``pid`` into it."""
    path = _fresh(parent, pid)
    (path / "memory.limit_in_bytes").write_text(str(limit))
    memsw = path / "memory.memsw.limit_in_bytes"
    if memsw.exists():
        memsw.write_text(str(limit))
    (path / "cgroup.procs").write_text(str(pid))
    return path


def v2_parent(pid: int, mounts: tuple[Path, ...] = (CGROUP_MOUNT, V2_HYBRID)) -> Path | str:
    """The v2 cgroup of ``pid`` if it can have a memory-limited child, else why not."""
    own = _own_cgroup(pid, lambda controllers: controllers == "")
    for mount in mounts:
        if not (mount / "cgroup.controllers").is_file():
            continue
        if own is None:
            return f"process {pid} is in no cgroup v2 (/proc/{pid}/cgroup)"
        parent = mount / own.lstrip("/")
        available = (parent / "cgroup.controllers").read_text().split()
        if "memory" not in available:
            return (f"cgroup v2 at {mount} has no memory controller for {parent} (it offers: "
                    f"{', '.join(available) or 'none'}; v1's may hold it)")
        if not os.access(parent, os.W_OK):
            return f"{parent} is not writable (needs root or a delegated cgroup)"
        return parent
    return f"no cgroup v2 is mounted at {' or '.join(map(str, mounts))}"


def v1_parent(pid: int, mount: Path = V1_MEMORY) -> Path | str:
    """The v1 memory cgroup of ``pid`` if a child can be made in it, else why not."""
    if not (mount / "memory.limit_in_bytes").is_file():
        return f"no cgroup v1 memory controller is mounted at {mount}"
    own = _own_cgroup(pid, lambda controllers: "memory" in controllers.split(","))
    parent = mount / (own or "/").lstrip("/")
    if not os.access(parent, os.W_OK):
        return f"{parent} is not writable (needs root or a delegated cgroup)"
    return parent


def _own_cgroup(pid: int, matches) -> str | None:
    """The path of ``pid``'s cgroup in the hierarchy whose controllers ``matches`` (the v2
    line has none), from /proc/PID/cgroup."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if matches(controllers):
                return path
    return None


def _fresh(parent: Path, pid: int) -> Path:
    """A new cgroup ``parent``/tierflow-PID; the empty ones left by processes gone are
    removed first (a cgroup can be removed only once no process is in it)."""
    for old in parent.glob("tierflow-*"):
        with contextlib.suppress(OSError):
            old.rmdir()
    path = parent / f"tierflow-{pid}"
    path.mkdir()
    return path


def _leave(path: Path, parent: Path) -> None:
    """At exit: back to the parent cgroup, and the cgroup removed (best effort: a v2 parent
    with controllers for its children takes no process, and its empty child stays until the
    next ``enforce`` there removes it)."""
    with contextlib.suppress(OSError):
        (parent / "cgroup.procs").write_text(str(os.getpid()))
        path.rmdir()
