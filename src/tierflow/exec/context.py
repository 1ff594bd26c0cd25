"""Replaying a stage exactly: the autocast mode and RNG state it first ran under."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass(frozen=True)
class AutocastMode:
    """The caller's autocast state for one device type, captured when the step starts."""

    device_type: str
    enabled: bool
    dtype: torch.dtype

    @classmethod
    def capture(cls, device_type: str) -> "AutocastMode":
        return cls(device_type, torch.is_autocast_enabled(device_type),
                   torch.get_autocast_dtype(device_type))

    def __call__(self) -> contextlib.AbstractContextManager:
        """Enter this mode. The weight-cast cache is off: a stage's casts live in its tape
        (where they are accounted) instead of piling up for the whole forward."""
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled,
                              cache_enabled=False)

    def describe(self) -> str:
        return f"autocast {str(self.dtype).replace('torch.', '')}" if self.enabled else "no autocast"


@dataclass
class RngState:
    """The CPU generator and, when computing on an accelerator, its generator."""

    cpu: torch.Tensor
    device: torch.device
    accel: torch.Tensor | None

    @classmethod
    def capture(cls, device: torch.device) -> "RngState":
        accel = None
        if device.type != "cpu":
            accel = torch.get_device_module(device).get_rng_state(device)
        return cls(torch.get_rng_state(), device, accel)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.accel is not None:
            torch.get_device_module(self.device).set_rng_state(self.accel, self.device)


@contextlib.contextmanager
def replay_rng(saved: RngState) -> Iterator[None]:
    """Run a recomputation with the RNG state of the first run, then put the live state back."""
    live = RngState.capture(saved.device)
    saved.restore()
    try:
        yield
    finally:
        live.restore()


class BufferState:
    """Copies of the buffers a stage's forward mutates (BatchNorm running statistics), so a
    recomputation sees the buffers of the first run and leaves them as the first run did."""

    def __init__(self, modules: list[torch.nn.Module]):
        self.buffers = [b for m in modules for b in m.buffers()]
        self.values = [b.detach().clone() for b in self.buffers]

    def swap(self) -> None:
        """Exchange the live buffers with the saved copies."""
        for buffer, value in zip(self.buffers, self.values):
            live = buffer.detach().clone()
            buffer.data.copy_(value)
            value.copy_(live)


@contextlib.contextmanager
def replay_buffers(saved: BufferState | None) -> Iterator[None]:
    """Run a recomputation on the buffers as they were before the first run, then put back
    the buffers as the first run left them."""
    if saved is None or not saved.buffers:
        yield
        return
    saved.swap()
    try:
        yield
    finally:
        saved.swap()


@contextlib.contextmanager
def untouched(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """Leave the model's buffers and the RNG streams as they were (profiling runs the model)."""
    saved = BufferState([model])
    rng = RngState.capture(device)
    try:
        yield
    finally:
        rng.restore()
        saved.swap()
