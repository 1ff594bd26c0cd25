"""Running a test scenario in a new interpreter, for tests that read the process's RSS: its
malloc heap then holds only what the scenario puts there, not what earlier tests left (in
full runs that heap made such readings drift: a second trim in test_host_memory, 31% more
AdamW temporaries in test_tiered_prediction; never in a run of either file alone)."""
import os
import subprocess
import sys
from pathlib import Path


def run_in_fresh_process(module: str, scenario: str, *args: str) -> None:
    """Call ``module.scenario(*args)`` (string arguments) in a new interpreter; its assertion
    errors fail the calling test with the scenario's stderr."""
    tests = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tests.parent / "src"), str(tests), os.environ.get("PYTHONPATH", "")]))
    call = f"import {module} as m; m.{scenario}(*{args!r})"
    proc = subprocess.run([sys.executable, "-c", call], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
