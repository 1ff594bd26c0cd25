"""Where a run's checkpoints are in its ``--out`` directory, apart from what they hold and
free of torch: ``step_N`` directories (complete once their ``trainer_state.json`` exists),
and the ``step_N.tmp-PID`` / ``step_N.replaced-PID`` directories of a save in progress. The
command line resolves ``--resume`` with ``checkpoint_directory`` before it imports torch."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from ..core.errors import TierflowError

STATE_FILE = "trainer_state.json"  # written last: a step_N directory holding it is complete
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TEMP_DIR = re.compile(r"^step_(\d+)\.(?:tmp|replaced)-(\d+)$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(out_dir: Path) -> None:
    """Temporary directories left by a process that died mid-save (kill -9). A replaced
    checkpoint whose successor never got its name is put back instead."""
    for entry in out_dir.iterdir():
        m = _TEMP_DIR.match(entry.name)
        pid = int(m.group(2)) if m else 0
        if m and entry.is_dir() and pid != os.getpid() and not _pid_alive(pid):
            final = out_dir / f"step_{m.group(1)}"
            if ".replaced-" in entry.name and not final.exists():
                entry.rename(final)
            else:
                shutil.rmtree(entry, ignore_errors=True)


def _steps(out_dir: Path) -> list[tuple[int, Path]]:
    found = []
    if out_dir.is_dir():
        for entry in out_dir.iterdir():
            m = _STEP_DIR.match(entry.name)
            if m and (entry / STATE_FILE).is_file():
                found.append((int(m.group(1)), entry))
    return sorted(found)


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step in ``out_dir`` (None when there is none).
    Temporary directories of interrupted saves are never returned."""
    found = _steps(Path(out_dir))
    return found[-1][1] if found else None


def intact_note(out_dir: Path) -> str:
    """What a failed save left: the previous checkpoint, for its error line."""
    previous = latest_checkpoint(out_dir)
    return (f"the previous checkpoint {previous.name} is intact" if previous is not None
            else "no earlier checkpoint existed")


def checkpoint_directory(path: str | Path) -> Path:
    """The checkpoint ``path`` names: itself when it is a ``step_N`` directory (it holds
    ``trainer_state.json``), else the latest complete one in it (a run's ``--out``); one
    line when there is none."""
    path = Path(path)
    if not path.is_dir():
        raise TierflowError(f"checkpoint {path} does not exist: pass a step_N directory "
                            "written by tierflow train, or the run's --out directory")
    if (path / STATE_FILE).is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise TierflowError(f"{path} is not a tierflow checkpoint (no {STATE_FILE}) and "
                            "holds no step_N checkpoint: pass a step_N directory written "
                            "by tierflow train")
    return latest
