"""``tierflow sweep``: predictions over a grid of models, sequence lengths and memory sizes,
written as one CSV and one heatmap PNG of predicted tokens/s per (model, sequence length)."""
from __future__ import annotations

import csv
import itertools
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from ..core.errors import BudgetError
from .predict import Prediction, predict
from .selection import Selection
from .setup import Setup
from .shapes import ModelShape

GIB = 2 ** 30
FIELDS = ("model", "hardware", "seq_len", "batch_size", "grad_accum", "gpu_gib", "ram_gib",
          "trainable_params", "fits", "tokens_per_s", "step_s", "mfu", "peak_gpu_gib",
          "peak_ram_gib", "peak_disk_gib", "weights_resident", "grads_resident",
          "optimizer_resident", "stages", "activations", "bottleneck")


@dataclass(frozen=True)
class Cell:
    shape: ModelShape
    seq: int
    gpu: int | None
    ram: int | None
    trainable: int  # the parameters that train
    prediction: Prediction | None  # None: nothing fits
    reason: str = ""  # why not, when nothing fits

    def row(self, hardware: str, batch: int, accum: int) -> dict:
        p = self.prediction
        pl = p.placement if p else None
        return {"model": self.shape.name, "hardware": hardware, "seq_len": self.seq,
                "batch_size": batch, "grad_accum": accum, "gpu_gib": _gib(self.gpu),
                "ram_gib": _gib(self.ram), "trainable_params": self.trainable,
                "fits": p is not None,
                "tokens_per_s": f"{p.tokens_per_second:.0f}" if p else "",
                "step_s": f"{p.step_time:.4g}" if p else "", "mfu": f"{p.mfu:.3f}" if p else "",
                "peak_gpu_gib": _gib(pl.peaks.get("gpu")) if pl else "",
                "peak_ram_gib": _gib(pl.peaks.get("ram")) if pl else "",
                "peak_disk_gib": _gib(pl.peaks.get("disk")) if pl else "",
                "weights_resident": pl.weights.resident if pl else "",
                "grads_resident": pl.grads.resident if pl else "",
                "optimizer_resident": pl.optimizer.resident if pl else "",
                "stages": pl.stages if pl else "", "activations": pl.activations if pl else "",
                "bottleneck": pl.bottleneck if pl else self.reason}


def sweep(base: Setup, models: list[tuple[ModelShape, Selection | None]], seqs: list[int],
          gpus: list[int | None], rams: list[int | None]) -> list[Cell]:
    """Predict every combination of the models (each with what trains in it: None, all),
    sequence lengths and budgets, one process per core; a combination nothing fits becomes
    a Cell without one, its reason the closest placement's."""
    setups = [replace(base, shape=shape, seq=seq, gpu=gpu, ram=ram, selection=selection)
              for (shape, selection), seq, gpu, ram
              in itertools.product(models, seqs, gpus, rams)]
    with ProcessPoolExecutor(max_workers=min(len(setups), os.cpu_count() or 1)) as pool:
        return list(pool.map(_cell, setups))


def _cell(setup: Setup) -> Cell:
    """The cell of one combination (in a worker process)."""
    trainable = setup.trains.total
    try:
        prediction = predict(setup, smallest_budgets=False)
    except BudgetError as e:
        return Cell(setup.shape, setup.seq, setup.gpu, setup.ram, trainable, None, str(e))
    return Cell(setup.shape, setup.seq, setup.gpu, setup.ram, trainable, prediction)


def write_csv(cells: list[Cell], path: Path, base: Setup) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for cell in cells:
            writer.writerow(cell.row(base.hardware.name, base.batch, base.grad_accum))


def heatmap(cells: list[Cell], path: Path, title: str) -> None:
    """Predicted tokens/s over GPU memory (rows) x RAM (columns), a value in every cell,
    cells where nothing fits hatched and marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    gpus = sorted({c.gpu for c in cells}, key=lambda v: -1 if v is None else v)
    rams = sorted({c.ram for c in cells}, key=lambda v: float("inf") if v is None else v)
    values = np.full((len(gpus), len(rams)), np.nan)
    for c in cells:
        if c.prediction is not None:
            values[gpus.index(c.gpu), rams.index(c.ram)] = c.prediction.tokens_per_second
    fig, ax = plt.subplots(figsize=(1.3 * len(rams) + 2.5, 0.8 * len(gpus) + 2))
    masked = np.ma.masked_invalid(values)
    image = ax.imshow(masked, cmap="viridis", origin="lower", aspect="auto")
    ax.set_facecolor("#dddddd")
    top = np.nanmax(values) if np.isfinite(values).any() else 1.0
    for (i, j), v in np.ndenumerate(values):
        if np.isnan(v):
            ax.text(j, i, "no fit", ha="center", va="center", color="#aa0000", fontsize=9)
        else:
            ax.text(j, i, _rate(v), ha="center", va="center", fontsize=9,
                    color="white" if v < 0.6 * top else "black")
    ax.set_xticks(range(len(rams)), [_label(r, "unlimited") for r in rams])
    ax.set_yticks(range(len(gpus)), [_label(g, "no GPU") for g in gpus])
    ax.set_xlabel("host RAM (GiB)")
    ax.set_ylabel("GPU memory (GiB)")
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, label="predicted tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _gib(v: int | None) -> str:
    return "" if v is None else f"{v / GIB:.2f}"


def _label(v: int | None, none: str) -> str:
    return none if v is None else f"{v / GIB:g}"


def _rate(v: float) -> str:
    return f"{v / 1e3:.1f}k" if v >= 1e3 else f"{v:.0f}"


def write_heatmaps(cells: list[Cell], out: Path, base: Setup) -> list[Path]:
    """One PNG per (model, sequence length)."""
    paths = []
    keys = dict.fromkeys((c.shape, c.seq) for c in cells)
    for shape, seq in keys:
        group = [c for c in cells if c.shape == shape and c.seq == seq]
        path = out / f"{Path(shape.name).name or 'model'}-seq{seq}.png"
        trains = group[0].trainable
        title = (f"PREDICTED tokens/s: {shape.name}, seq {seq} x batch {base.batch} x "
                 f"grad-accum {base.grad_accum} on {base.hardware.name}\n"
                 f"{base.run_precision.describe()}"
                 + (f"; {trains / shape.total_params():.1%} of the parameters train"
                    if trains < shape.total_params() else ""))
        heatmap(group, path, title)
        paths.append(path)
    return paths
