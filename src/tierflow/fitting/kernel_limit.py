"""The last step of ``fit`` under ``FitConfig(enforce=True)``: the kernel, not a measurement
after the fact, holds the process to its RAM budget from the first step on (a memory cgroup,
``tierflow/exec/enforce.py``). Entered once the step is planned, so that a budget the plan refuses
is refused in one line before anything runs under the limit."""
from __future__ import annotations

from ..core.errors import TierflowError
from ..exec import enforce
from ..exec.memory import return_free_memory, rss_bytes
from .request import FitRequest
from .start import FitStart


def hold_to_budget(request: FitRequest, start: FitStart) -> enforce.Enforced | None:
    """Move the process into a memory cgroup whose limit is the RAM budget less what the
    process holds of it already (above ``start.outside_budget``, the RSS the budget does not
    cover), or, where none can be made and ``unenforced_ok``, say why and return None."""
    config = request.config
    if not config.enforce:
        return None
    if start.tier != "ram" or start.budget is None:
        raise TierflowError(f"enforce=True holds a RAM budget of the CPU, and this fit's "
                            f"compute tier is {start.tier} with budget {start.budget}: give "
                            "ram= with the model and sample on the CPU, or leave enforce off")
    return_free_memory()  # malloc's caches are not the process's to keep charged
    return enforce.hold(start.budget, start.outside_budget, rss_bytes(),
                        unenforced_ok=config.unenforced_ok, say=start.say, name="ram=")
