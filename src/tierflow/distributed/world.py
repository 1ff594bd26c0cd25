"""The default process group: joining it from torchrun's environment, and what a lost rank
looks like to the ranks that are left.

``join_from_env`` reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (what
``torchrun`` sets, or a launcher of one's own) and initialises the default process group with
one backend per device type: gloo for CPU tensors, NCCL for CUDA tensors when CUDA is there.
Without ``WORLD_SIZE`` (or with a world of one) it returns None and the trainer is the plain
single process.

Every blocking collective runs inside ``World.collective(what)``: a peer that died (the
connection resets) or stopped answering (the ``timeout`` passes) becomes one
``RankLostError`` line naming the rank that stopped, found by asking the rendezvous store
which ranks are still alive.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from ..core.errors import TierflowError
from ..core.torchrun_env import world_size_from_env

_ALIVE = "tierflow/alive/{}"
_CLOSED = "tierflow/closed/{}"
_PROBE_SECONDS = 3.0  # how long a survivor waits for the others to say they are alive


class RankLostError(TierflowError):
    """Another rank died or stopped answering; this one cannot go on alone."""


@dataclass
class World:
    """This process's place in the default process group."""
    rank: int
    size: int
    backend: str  # e.g. "gloo" or "cpu:gloo,cuda:nccl"
    timeout: float  # seconds a collective waits for the slowest rank
    store: dist.Store
    step: int = 0  # the training step, named in errors

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @contextlib.contextmanager
    def collective(self, what: str) -> Iterator[None]:
        """Run blocking collectives; a failure becomes one ``RankLostError`` line."""
        try:
            yield
        except RuntimeError as err:  # gloo/NCCL raise RuntimeError (or its Dist* subclasses)
            raise RankLostError(self._lost(what, err)) from None

    def all_gather(self, values: list[float], what: str) -> list[list[float]]:
        """Every rank's ``values`` (a few numbers: losses, byte counts, flags), by rank."""
        mine = torch.tensor(values, dtype=torch.float64)  # (k,)
        every = torch.empty(self.size * len(values), dtype=torch.float64)  # (N * k,)
        with self.collective(what):
            dist.all_gather_single(every, mine)
        return every.view(self.size, len(values)).tolist()

    def average(self, tensors: list[torch.Tensor]) -> None:
        """Replace each of ``tensors`` (one stage's gradients) in place by its mean over the
        ranks: all-reduced (summed) together, then divided by the world size, as DDP does.
        The replicas of ``tierflow train --disk`` then update identically."""
        with self.collective("gradient reduction"):
            works = [dist.all_reduce(t, async_op=True) for t in tensors]
            for work in works:
                work.wait()
        for t in tensors:
            t.div_(self.size)

    def barrier(self, what: str) -> None:
        with self.collective(what):
            dist.barrier()

    def _lost(self, what: str, err: RuntimeError) -> str:
        first = _first_sentence(err)
        timed_out = "timeout" in first.lower() or "timed out" in first.lower()
        missing = self._missing_ranks()
        if missing is None:
            who = "rank 0 (it holds the rendezvous store, which no longer answers)"
        elif missing:
            who = "rank " + ", ".join(map(str, missing))
        else:
            who = "another rank (all answered the store, so one is hanging or too slow)"
        happened = (f"did not answer within --dist-timeout {self.timeout:g} s" if timed_out
                    else f"stopped ({first})")
        when = (f"during the {what} of step {self.step}; nothing was saved for this step"
                if self.step else f"during the {what}, before training started")
        return (f"rank {self.rank}: {who} {happened} {when}; fix: read that rank's output for "
                "its error (or the kernel log for the OOM killer), then restart, with --resume "
                "OUT if a checkpoint was written (on any number of ranks)")

    def _missing_ranks(self) -> list[int] | None:
        """Ranks that did not say they are alive within a few seconds; None when the store
        itself is gone (it lives in rank 0's process unless torchrun's agent holds it)."""
        try:
            self.store.set(_ALIVE.format(self.rank), "1")
            others = [r for r in range(self.size) if r != self.rank]
            deadline = time.monotonic() + min(_PROBE_SECONDS, self.timeout)
            while True:
                missing = [r for r in others if not self.store.check([_ALIVE.format(r)])]
                if not missing or time.monotonic() > deadline:
                    return missing
                time.sleep(0.05)
        except RuntimeError:
            return None

    def close(self, *, finished: bool) -> None:
        """Leave the process group. After a finished run rank 0, whose process holds the
        rendezvous store, waits for the others to be out first (a store that vanishes under
        a rank still leaving aborts it); after a failure nobody waits."""
        if dist.is_initialized():
            dist.destroy_process_group()
        if not finished:
            return
        with contextlib.suppress(RuntimeError):
            if self.rank == 0:
                others = [_CLOSED.format(r) for r in range(1, self.size)]
                self.store.wait(others, datetime.timedelta(seconds=self.timeout))
            else:
                self.store.set(_CLOSED.format(self.rank), "1")


def exit_rank(code: int) -> NoReturn:
    """End a rank's process with ``code`` now that its run is over: everything is written and
    it has left the process group. Skipping the interpreter's teardown is deliberate: the
    process group's and the store's C++ objects are then destroyed in an order that has
    aborted a rank after a finished run ("terminate called without an active exception",
    exit code 134), which torchrun reports as a failed run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _first_sentence(err: BaseException) -> str:
    """The backend's message without its source location, up to its first full stop."""
    text = " ".join(str(err).split())
    text = re.sub(r"^\[[^\]]*\.(?:cpp|cc|h):\d+\]\s*", "", text)
    return text.split(". ")[0][:160] or type(err).__name__


def join_from_env(timeout: float) -> World | None:
    """Join the default process group described by torchrun's environment (None when the
    world is one process). ``timeout`` bounds every wait on another rank, in seconds."""
    size = world_size_from_env()
    if size == 1:
        return None
    env = {k: os.environ.get(k) for k in ("RANK", "MASTER_ADDR", "MASTER_PORT")}
    absent = [k for k, v in env.items() if not v]
    if absent:
        raise TierflowError(f"WORLD_SIZE={size} but {', '.join(absent)} is not set: launch with "
                            "'torchrun --nproc-per-node N -m tierflow train ...'")
    rank = int(env["RANK"])
    if not 0 <= rank < size:
        raise TierflowError(f"RANK={rank} is outside WORLD_SIZE={size}: launch with torchrun")
    wait = datetime.timedelta(seconds=timeout)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), size,
                              is_master=rank == 0 and not agent_store, timeout=wait)
    except RuntimeError as err:
        raise TierflowError(f"rank {rank} cannot reach the rendezvous at {env['MASTER_ADDR']}:"
                            f"{env['MASTER_PORT']} within --dist-timeout {timeout:g} s "
                            f"({_first_sentence(err)}): start every rank, or pick a "
                            "free --master-port") from None
    if agent_store:  # torchrun's store outlives restarts: keep each attempt's keys apart
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"/worker/attempt_{attempt}", store)
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    world = World(rank, size, backend, timeout, store)
    with world.collective("process group setup"):
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=wait)
    return world
