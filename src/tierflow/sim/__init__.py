"""The planner as a simulator: predict a training run on hardware you may not have.

``shapes`` reads a model's shape from a preset or ``config.json``; ``stages`` turns it into
the ``ChainCosts`` the profiler would measure; ``hardware`` holds the published profiles and
``calibrate`` the ``cpu`` one, measured with the probes of ``profile/`` (its
``hardware(name)`` returns either); ``predict`` runs the trainer's own placement search on
them (``tiered``, reported as a ``plan/placement.py`` ``Placement``); ``sweep`` repeats it over a grid; ``selection`` and
``freeze`` say what a partial fine-tune trains. No torch is imported except while the cpu
profile is measured and by ``freeze`` (which builds the model on the meta device). The
commands are ``cli/plan.py``, ``cli/sweep.py`` and ``cli/calibrate.py``.
"""
from .calibrate import hardware
from .hardware import Hardware
from .predict import Prediction, predict
from .setup import Setup

__all__ = ["Hardware", "Prediction", "Setup", "hardware", "predict"]
