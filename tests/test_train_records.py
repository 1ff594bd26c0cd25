"""The records a run of ``tierflow train`` is handed down as (``train/run.py``) and the
figures of its ``[T]`` line (``logger.StepLine``), checked without training."""
from __future__ import annotations

import pytest

from tierflow.train.logger import StepLine
from tierflow.train.options import TrainOptions
from tierflow.train.run import DEFAULT_STEPS, Schedule


def _opts(**values) -> TrainOptions:
    return TrainOptions(model="llama-20m", data="d", **values, given=frozenset(values))


def test_the_schedule_of_the_options():
    assert Schedule.of(_opts(steps=40), 10_000) == Schedule(40, 2, 3e-4 / 10, 1024)
    assert Schedule.of(_opts(), 10_000).total == DEFAULT_STEPS
    # 2.5 passes over 10,000 tokens at 4 x 2 x 256 tokens a step: 12.2, rounded up
    epochs = Schedule.of(_opts(epochs=2.5, grad_accum=2, warmup=0, min_lr=1e-5), 10_000)
    assert epochs == Schedule(13, 0, 1e-5, 2048)
    assert epochs.lr(1, 3e-4) == pytest.approx(3e-4)  # no warmup: the peak first
    assert epochs.lr(13, 3e-4) == pytest.approx(1e-5)  # the cosine ends at min_lr


def test_the_step_line():
    line = StepLine(step=12, total=384, ms=1869.2, norm=4.314, loss=3.2821, tok_s=35_100,
                    sol=0.429, ram_bytes=3 * 2 ** 30, budget=4 * 2 ** 30)
    assert line.text() == ("[T] step 12 [ 3.1%] | 1869 ms | norm 4.31 | loss 3.282 | "
                           "35.1k tok/s | sol 42.9% | ram 3.0/4.0 GiB")
    gpu = StepLine(step=1, total=1, ms=1.0, norm=1.0, loss=1.0, tok_s=1.0, sol=None,
                   ram_bytes=None, budget=None, gpu_bytes=2 ** 30, gpu_budget=2 * 2 ** 30)
    assert gpu.text().endswith("| sol - | ram -/- GiB | gpu 1.0/2.0 GiB")
