"""Measure what a tier really holds: host RSS (and its peak) on CPU, the allocator on CUDA.

Host RAM is measured as the process's resident set, since that is what a budget on a machine
means. For that to track live tensors, glibc must hand freed blocks back to the kernel:
``configure_host_allocator`` pins malloc's mmap threshold (the dynamic threshold otherwise
grows to 32 MiB and keeps freed activations resident, up to ~25% above the live bytes on W1).
The price is a page fault on every fresh page: on W1 a step takes ~30% longer. So ``fit``
profiles with the exact setting when a RAM budget is given, then lets malloc cache freed
blocks again and ``HostRoom`` gives them back only before an operation that could otherwise
push the RSS past the plan's predicted peak.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import resource
import sys
import threading
import time
import weakref
from collections.abc import Iterator

import torch

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
EXACT_THRESHOLD = 1 << 20  # blocks of 1 MiB and more get their own mapping, freed at once
CACHING_THRESHOLD = 32 << 20  # glibc's own steady state: freed blocks stay for reuse
GUARD_INTERVAL = 0.001  # seconds between the RSS guard's looks at the RSS
# what the RSS may grow by while the guard reacts (its look, a trim of a few ms, the GIL's
# 5 ms switch interval) at the ~1.5 GB/s this machine faults fresh pages in: it trims this
# far below the level it holds
GUARD_MARGIN = 32 << 20
# the fastest the RSS grows (fresh pages faulted in at the speed of memset): a guard whose
# RSS is far below its level looks again only once it could have come within the margin,
# and at least every GUARD_LONGEST seconds. Looking every millisecond, the guard thread
# took 8% of a core on a 2-core machine (10 s of CPU in 125 s of W1 at 25% of its peak)
GUARD_FASTEST_GROWTH = 20e9  # bytes per second
GUARD_LONGEST = 0.05  # seconds
GUARD_LEAST_GROWTH = 1 << 20  # bytes: the least growth a guard trims again after
# bytes of RSS a plan of a host-RAM budget leaves for malloc beyond the live bytes it prices:
# blocks freed into malloc's caches that the guard gives back a look too late (a millisecond
# of growth, and up to GUARD_LEAST_GROWTH before it trims again), the objects fit itself
# builds after measuring the runtime (lazily imported modules, the plan) and AdamW's
# per-parameter step tensors and dicts. At the smallest budget fit named for llama-tiny the
# steps peaked 1.2 to 3.0 MiB above a plan that counted none (six runs, 63 MiB:
# benchmarks/smallest_budget_held.py, results/smallest-budget-held-2026-12-07-before.json)
ALLOCATOR_SLACK = 4 << 20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """glibc, loaded once (``find_library`` runs ``ldconfig``), or None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt"):
        return None
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _MallInfo2
    return libc


def configure_host_allocator(threshold: int = EXACT_THRESHOLD) -> bool:
    """Set glibc's mmap and trim thresholds (glibc only; a no-op elsewhere). With
    EXACT_THRESHOLD freed tensors leave the RSS at once; CACHING_THRESHOLD lets malloc keep
    them for reuse, which saves the page faults of fresh memory."""
    libc = _glibc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, threshold) == 1
    return libc.mallopt(_M_TRIM_THRESHOLD, 2 * threshold) == 1 and ok


@contextlib.contextmanager
def caching_allocator(level: int | None = None) -> Iterator[None]:
    """Run the block with malloc's caching thresholds, then give its caches back and pin the
    exact ones again (to time work as steps run it while memory is measured exactly).
    ``level``: bytes of RSS the block must stay under (the budget's): a thread gives the
    caches back as the RSS comes near it, as a step's ``HostRoom`` guard does. Freed blocks
    under the caching threshold stay resident: the bf16 logits and weight cast of the fused
    LM head's profile (31 and 16 MiB for llama-20m at 512 tokens, where their fp32 logits
    get a mapping of their own) grew the RSS 90 MiB past the exact rounds' peak and past
    --ram 240MiB."""
    configure_host_allocator(CACHING_THRESHOLD)
    done = threading.Event()
    guard = None if level is None else threading.Thread(
        target=_guard_until, args=(level, done, GUARD_INTERVAL), daemon=True,
        name="tierflow-rss-guard-timing")
    if guard is not None:
        guard.start()
    try:
        yield
    finally:
        done.set()
        if guard is not None:
            guard.join()
        configure_host_allocator(EXACT_THRESHOLD)
        return_free_memory()


def return_free_memory() -> None:
    """Give the free memory every malloc arena holds back to the system (glibc's
    ``malloc_trim``): small blocks freed by other threads stay in their arenas otherwise, and
    would be mistaken for memory the runtime needs."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


class HostRoom:
    """Keeps the RSS under ``limit`` while malloc caches freed blocks: before an operation
    that may add ``nbytes`` at its peak, the caches go back to the kernel if the RSS now plus
    what the operation needs beyond malloc's resident free blocks would pass the limit. Steps
    far from the budget keep their caches (no page faults); steps near it pay the faults where
    needed.

    malloc's resident free blocks are the RSS less the bytes malloc has handed out less what
    is resident outside malloc (code, stacks). That last part is measured right after each
    trim, when the caches are empty, and the largest measurement is kept: blocks handed out
    but not yet touched (a buffer an I/O thread is about to fill) make one measurement low,
    and a low one would count live bytes as cache. Until the first trim, and while the RSS is
    past the limit, they count as none. Nor do they count for an operation whose growth is
    ``fresh``: allocations of malloc's mmap threshold and more (a streamed stage's weights
    and their gradients) are new mappings that free blocks cannot serve. Nor for the
    operation's ``largest`` blocks, its gradient and its largest tensor as the profiler
    counted it: free blocks are scattered pieces, a 31 MiB gradient grew the heap beside 147
    MiB of them, and the fused LM head's 125 MiB chunk of logits is a mapping of its own.

    What an operation's growth is made of is not always known: buffers the I/O threads fill
    beside the operations are mappings too, and the profiler counts no tensors of compiled
    stages.
    ``start_guard(level)`` adds a thread that looks at the RSS every millisecond and gives the
    caches back as soon as it comes within ``GUARD_MARGIN`` of ``level``; then again only once
    the RSS has grown by half that margin since (what was freed meanwhile went to the caches
    again), or after it fell below the margin. Trimming once per excursion let a llama-20m run
    that stayed within the margin after its trim grow 13 MiB past --ram 500MiB in a later
    backward. ``guard_prediction()`` guards the limit itself, the predicted peak, up to the
    ``ceiling`` (the budget): caches held inside one long operation (the LM head's forward,
    a first update creating its states beside the backward's freed blocks) took W1 at 50% of
    plain PyTorch's peak 2-12% past its prediction with the guard at the budget.
    """

    def __init__(self, limit: int, ceiling: int | None = None) -> None:
        self.limit = limit  # bytes of RSS, the process's own share included
        self.ceiling = ceiling  # the budget's bytes of RSS: no guard level above it
        self.trims = 0
        self.guard_level: int | None = None  # bytes of RSS the guard thread holds to
        self.guard_trims = 0  # trims by the guard thread
        self.guards_prediction = False  # the guard's level follows the limit
        self._outside_malloc: int | None = None

    def start_guard(self, level: int, interval: float = GUARD_INTERVAL) -> None:
        """Watch the RSS from a daemon thread. One HostRoom per process is guarded, the last
        one started: the thread ends when a later one starts or this one is collected."""
        global _guarded
        started = self.guard_level is not None
        self.guard_level = level
        _guarded = weakref.ref(self)
        if not started:
            threading.Thread(target=_guard, args=(_guarded, interval), daemon=True,
                             name="tierflow-rss-guard").start()

    def guard_prediction(self) -> None:
        """Guard the limit: trim as soon as the RSS passes it (``GUARD_MARGIN`` above it, as
        ``start_guard`` trims within the margin of its level), never above the ceiling."""
        level = self.limit + GUARD_MARGIN
        self.start_guard(level if self.ceiling is None else min(level, self.ceiling))
        self.guards_prediction = True

    def moved(self, delta: int) -> HostRoom:
        """The room of another plan of the same run: its limit ``delta`` bytes away (the new
        plan's predicted peak less the old one's), the same ceiling, what was measured outside
        malloc kept, and its level guarded (from now on by the new room's thread): the new
        prediction where this room guarded its own, else the same level."""
        room = HostRoom(self.limit + delta, self.ceiling)
        room._outside_malloc = self._outside_malloc
        if self.guards_prediction:
            room.guard_prediction()
        elif self.guard_level is not None:
            room.start_guard(self.guard_level)
        return room

    def make_room(self, nbytes: int, fresh: bool = False, largest: int = 0) -> None:
        """Trim before an operation that adds up to ``nbytes`` if the RSS would pass the
        limit. ``largest``: the bytes of the large single blocks the operation allocates.
        malloc's free blocks are scattered pieces, so they serve at most
        ``nbytes - largest``."""
        rss = rss_bytes()
        cached = 0 if fresh else min(self._cached(rss), max(0, nbytes - largest))
        if rss + nbytes > self.limit and rss + nbytes - cached > self.limit:
            return_free_memory()
            self.trims += 1
            in_use = malloc_in_use()
            if in_use is not None:
                outside = rss_bytes() - in_use
                self._outside_malloc = max(outside, self._outside_malloc or outside)

    def _cached(self, rss: int) -> int:
        """Bytes of malloc's free blocks that are resident now (0 when unknown)."""
        in_use = malloc_in_use()
        if in_use is None or self._outside_malloc is None or rss > self.limit:
            return 0
        return max(0, rss - in_use - self._outside_malloc)


_guarded: weakref.ref | None = None  # the HostRoom whose guard runs


def _guard(room_ref: weakref.ref, interval: float) -> None:
    """The guard thread of a HostRoom: trim when the RSS comes within GUARD_MARGIN of its
    level, and again each time it has grown by half the margin since the last trim."""
    trimmed_at: int | None = None  # the RSS right after the last trim of this excursion
    while (room := room_ref()) is not None and _guarded() is room:
        level = room.guard_level
        trimmed, trimmed_at, rss = _trim_near(level, trimmed_at)
        room.guard_trims += trimmed
        del room
        time.sleep(_next_look(level, rss, interval))


def _guard_until(level: int, done: threading.Event, interval: float) -> None:
    """A guard for ``level`` (as ``_guard``) until ``done`` is set."""
    trimmed_at: int | None = None
    while not done.is_set():
        _, trimmed_at, rss = _trim_near(level, trimmed_at)
        done.wait(_next_look(level, rss, interval))


def _trim_near(level: int, trimmed_at: int | None) -> tuple[bool, int | None, int]:
    """One look of a guard: trim when the RSS is within GUARD_MARGIN of ``level`` and, in
    the same excursion, has grown since the last trim (the RSS right after it:
    ``trimmed_at``) by half the margin or by half the room that trim left below ``level``,
    whichever is less (at least GUARD_LEAST_GROWTH). Whether it trimmed, the new
    ``trimmed_at`` and the RSS."""
    rss = rss_bytes()
    if rss <= level - GUARD_MARGIN:
        return False, None, rss
    if trimmed_at is None or rss > trimmed_at + _retrim_growth(level, trimmed_at):
        return_free_memory()
        after = rss_bytes()
        return True, after, after
    return False, trimmed_at, rss


def _retrim_growth(level: int, trimmed_at: int) -> int:
    """Bytes the RSS may grow by after a trim before the guard trims again: half the margin,
    or half the room left below ``level`` where that is less. A small model's whole step
    runs within the margin of its level (``tierflow compare --quick``: 64 MiB), and half the
    margin (16 MiB) is more than the room such a budget leaves above the step's live
    bytes."""
    return min(GUARD_MARGIN // 2, max(GUARD_LEAST_GROWTH, (level - trimmed_at) // 2))


def _next_look(level: int, rss: int, interval: float) -> float:
    """Seconds until a guard's next look: ``interval`` within reach of its margin, longer
    while the RSS could not come within GUARD_MARGIN of ``level`` sooner at
    GUARD_FASTEST_GROWTH, at most GUARD_LONGEST."""
    far = level - GUARD_MARGIN - rss
    return min(GUARD_LONGEST, max(interval, far / GUARD_FASTEST_GROWTH))


def malloc_in_use() -> int | None:
    """Bytes malloc has handed out and not had back, mapped blocks included (glibc 2.33+'s
    ``mallinfo2``); None elsewhere."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


_statm: tuple[int, int] | None = None  # (pid, fd): this process's /proc/self/statm, open


def rss_bytes() -> int:
    """The process's resident set now: a read of its statm, kept open (opening it took 20
    of the 22 us a read took, and a guard reads it up to every millisecond); opened again in
    a forked child, whose /proc/self is another."""
    global _statm
    try:
        if _statm is None or _statm[0] != os.getpid():
            if _statm is not None:
                os.close(_statm[1])
            _statm = (os.getpid(), os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC))
        return int(os.pread(_statm[1], 128, 0).split()[1]) * _PAGE_BYTES
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class HostMeter:
    """Current RSS, and its peak over an interval sampled by a background thread.

    The process's own high-water mark (VmHWM, ``ru_maxrss``) is left alone: resetting it
    would hide earlier peaks from whoever measures this process. The sampler reads
    /proc/self/statm every ``interval`` seconds while torch works (kernels release the GIL);
    a transient shorter than that may be missed. ``interval`` None: no sampler, the peak is
    the larger of the RSS at ``reset_peak`` and at ``peak`` (a meter for work that is timed:
    the sampler's wake-ups preempt one of the kernels' threads on a 2-core machine: a W1
    layer's backward took 11% longer beside it, `benchmarks/sampler_cost.py`).
    """

    def __init__(self, interval: float | None = 0.0005) -> None:
        self.interval = interval
        self._peak = 0
        self._sampling = threading.Event()
        self._thread: threading.Thread | None = None

    def current(self) -> int:
        return rss_bytes()

    def finish(self) -> None:
        """Until the work queued so far is done: on the CPU it is when its call returns."""

    def reset_peak(self) -> None:
        self._peak = rss_bytes()
        if self._thread is None and self.interval is not None:
            self._thread = threading.Thread(target=self._sample, name="tierflow-rss", daemon=True)
            self._thread.start()
        self._sampling.set()

    def peak(self) -> int:
        """The highest RSS seen since ``reset_peak``; sampling stops until the next reset."""
        self._sampling.clear()
        self._peak = max(self._peak, rss_bytes())
        return self._peak

    def _sample(self) -> None:
        while True:
            self._sampling.wait()
            self._peak = max(self._peak, rss_bytes())
            time.sleep(self.interval)


class DeviceMeter:
    """Allocator-level current and peak bytes of an accelerator (CUDA, XPU, ...)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.module = torch.get_device_module(device)

    def current(self) -> int:
        return int(self.module.memory_allocated(self.device))

    def finish(self) -> None:
        """Until the kernels queued so far have run (a timing read before it would time
        their launches only)."""
        self.module.synchronize(self.device)

    def reset_peak(self) -> None:
        self.module.synchronize(self.device)
        self.module.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        self.module.synchronize(self.device)
        return int(self.module.max_memory_allocated(self.device))


_HOST_METER: HostMeter | None = None


def meter_for(device: torch.device) -> HostMeter | DeviceMeter:
    """The meter of the tier ``device`` computes in (one host meter per process)."""
    global _HOST_METER
    if device.type != "cpu":
        return DeviceMeter(device)
    if _HOST_METER is None:
        _HOST_METER = HostMeter()
    return _HOST_METER
