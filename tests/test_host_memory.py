"""The host allocator policy of RAM budgets: malloc caches freed blocks, HostRoom gives them
back before an operation that would otherwise pass the budget."""
import sys
import threading
import time

import pytest
import torch
from fresh_process import run_in_fresh_process

from tierflow.exec.memory import (
    CACHING_THRESHOLD,
    GUARD_MARGIN,
    HostRoom,
    caching_allocator,
    configure_host_allocator,
    rss_bytes,
)

MIB = 1 << 20

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")


def _wait_for_guard_trims(room: HostRoom, count: int) -> None:
    """Until ``room``'s guard has trimmed ``count`` times, at most a second."""
    for _ in range(200):
        if room.guard_trims >= count:
            break
        time.sleep(0.005)


def _cache_freed_blocks() -> int:
    """Touch and free 48 MiB in 4 MiB blocks (below the mmap threshold: malloc keeps them)."""
    configure_host_allocator(CACHING_THRESHOLD)
    blocks = [torch.ones(4 * MIB // 4) for _ in range(12)]  # 12 x 4 MiB, pages touched
    del blocks
    return rss_bytes()


def test_room_left_keeps_malloc_caches():
    cached = _cache_freed_blocks()
    room = HostRoom(limit=cached + 256 * MIB)
    room.make_room(64 * MIB)
    assert room.trims == 0
    assert rss_bytes() > cached - 8 * MIB  # the freed blocks are still resident


def test_no_room_gives_the_caches_back():
    cached = _cache_freed_blocks()
    room = HostRoom(limit=cached)
    room.make_room(MIB)  # RSS + 1 MiB passes the limit
    assert room.trims == 1
    assert rss_bytes() < cached - 32 * MIB  # most of the 48 MiB went back to the kernel


def test_cached_blocks_serve_the_growth_without_a_trim():
    run_in_fresh_process("test_host_memory", "_cached_blocks_serve_the_growth")


# The RSS can move by a few pages between two reads with nothing allocated in between (pages
# faulted back in, interpreter arenas): a limit at the RSS just read was passed that way in
# two full-suite runs (2026-11-23), and past its limit a HostRoom counts no cache, as it should.
SLACK = 8 * MIB


def _measured_room() -> HostRoom:
    """A HostRoom that has trimmed once (which measures what is resident outside malloc),
    then 48 MiB of freed blocks in malloc's caches and the limit ``SLACK`` above the RSS."""
    _cache_freed_blocks()
    room = HostRoom(limit=0)
    room.make_room(MIB)
    assert room.trims == 1
    room.limit = _cache_freed_blocks() + SLACK
    return room


def _cached_blocks_serve_the_growth() -> None:
    room = _measured_room()
    room.make_room(SLACK + 16 * MIB)  # served by the cached blocks: the RSS will not grow
    assert room.trims == 1
    room.make_room(SLACK + 96 * MIB)  # 48 MiB beyond the caches: they go back
    assert room.trims == 2


def test_fresh_growth_is_not_served_by_cached_blocks():
    """An operation whose growth is large fresh mappings (a streamed stage's weights and
    gradients) gets no credit for malloc's cached blocks: past the limit, they go back."""
    run_in_fresh_process("test_host_memory", "_fresh_growth_is_not_served")


def _fresh_growth_is_not_served() -> None:
    room = _measured_room()
    room.make_room(SLACK + 16 * MIB)  # small blocks: the cache serves them
    assert room.trims == 1
    room.make_room(SLACK + 16 * MIB, fresh=True)  # the same growth as new mappings: trim
    assert room.trims == 2


def test_cached_blocks_serve_no_block_larger_than_them():
    """malloc's free blocks are scattered pieces (48 MiB of 4 MiB blocks here): an operation
    whose growth is one 16 MiB block (a parameter's gradient) cannot be served from them, so
    they go back when the RSS plus that block would pass the limit. Without this a rotor run
    under --ram 600MiB peaked at 601.3 MiB: the LM head's 31 MiB weight gradient and logits
    chunk grew the heap beside 147 MiB of free pieces. (In a fresh process, as above.)"""
    run_in_fresh_process("test_host_memory", "_cached_blocks_serve_no_larger_block")


def _cached_blocks_serve_no_larger_block() -> None:
    room = _measured_room()
    room.make_room(SLACK + 16 * MIB, largest=4 * MIB)  # pieces of the cache's size: served
    assert room.trims == 1
    room.make_room(SLACK + 16 * MIB, largest=16 * MIB)  # one block larger than any piece
    assert room.trims == 2


def test_the_guard_gives_the_caches_back_when_a_fresh_mapping_passes_the_limit():
    """Growth HostRoom was not asked about (a large fresh mapping beside 48 MiB of cached
    blocks) takes the RSS past the guard's level: the guard thread trims, once for the
    excursion. (In a fresh process: threads that earlier tests left in this one may move
    the RSS by the margins the test counts on.)"""
    run_in_fresh_process("test_host_memory", "_guard_trims_once")


def _guard_trims_once() -> None:
    cached = _cache_freed_blocks()
    room = HostRoom(limit=cached)
    room.start_guard(cached + GUARD_MARGIN + 16 * MIB)
    fresh = torch.ones(64 * MIB // 4)  # a mapping of its own: the cached blocks cannot serve it
    _wait_for_guard_trims(room, 1)
    assert room.guard_trims == 1 and room.trims == 0
    assert rss_bytes() < cached + 64 * MIB - 32 * MIB  # most of the 48 MiB went back
    time.sleep(0.05)
    assert room.guard_trims == 1  # still over the limit with nothing cached: no more trims
    del fresh


def test_a_room_guarding_its_prediction_trims_past_it_and_never_above_the_budget():
    """``guard_prediction``: the guard's level is the limit (the predicted peak) plus the
    margin, so that it trims once the RSS passes the prediction, but never above the
    ceiling (the budget); a room moved to another plan guards that plan's prediction."""
    room = HostRoom(limit=1 << 40, ceiling=(1 << 40) + GUARD_MARGIN // 2)
    room.guard_prediction()
    assert room.guard_level == (1 << 40) + GUARD_MARGIN // 2  # the ceiling
    moved = room.moved(-(1 << 30))
    assert moved.guards_prediction and moved.ceiling == room.ceiling
    assert moved.guard_level == (1 << 40) - (1 << 30) + GUARD_MARGIN
    budget_guard = HostRoom(limit=1 << 40)
    budget_guard.start_guard(1 << 41)
    assert budget_guard.moved(-(1 << 30)).guard_level == 1 << 41  # the same level


def test_the_guard_trims_again_when_the_rss_keeps_growing_near_its_level():
    """After a trim the RSS may stay within the margin of the level and grow on (what is freed
    meanwhile goes to malloc's caches again): the guard trims again once it has grown by half
    the margin since, not only after it fell below the margin. (In a fresh process, as
    above.)"""
    run_in_fresh_process("test_host_memory", "_guard_trims_again")


def _guard_trims_again() -> None:
    configure_host_allocator(CACHING_THRESHOLD)
    room = HostRoom(limit=0)
    room.start_guard(rss_bytes() + GUARD_MARGIN // 4)  # within the margin: it trims at once
    _wait_for_guard_trims(room, 1)
    assert room.guard_trims == 1
    time.sleep(0.05)
    assert room.guard_trims == 1  # the RSS did not grow: no more trims
    live = torch.ones(GUARD_MARGIN // 4)  # the RSS grows by GUARD_MARGIN
    _wait_for_guard_trims(room, 2)
    assert room.guard_trims >= 2
    del live


def test_near_its_level_the_guard_trims_again_after_half_the_room_left():
    """A trim that leaves less than the margin below the level (a small model's budget: its
    whole step runs within the margin) is followed by another once the RSS has grown by half
    the room left, not half the margin: 6 MiB of growth 8 MiB below the level trims again,
    where 16 MiB had to pass first. (In a fresh process, as above.)"""
    run_in_fresh_process("test_host_memory", "_guard_trims_within_the_room")


def _guard_trims_within_the_room() -> None:
    configure_host_allocator(CACHING_THRESHOLD)
    room = HostRoom(limit=0)
    room.start_guard(rss_bytes() + 8 * MIB)  # within the margin: it trims at once
    _wait_for_guard_trims(room, 1)
    assert room.guard_trims == 1
    live = torch.ones(6 * MIB // 4)  # the RSS grows by 6 MiB, past half the 8 MiB left
    _wait_for_guard_trims(room, 2)
    assert room.guard_trims >= 2
    del live


def test_the_profile_times_under_a_guard_of_the_budget():
    """The profile times its stages with malloc's caches on (``caching_allocator``): given
    the budget's level, its block gives them back as the RSS comes near it; without one it
    never trims before its end. (The fused LM head's bf16 logits sit under the caching
    threshold: timing its profile rounds took llama-20m 90 MiB past their exact peak, past
    --ram 240MiB.) In a fresh process, as above."""
    run_in_fresh_process("test_host_memory", "_timing_guarded")


def _timing_guarded() -> None:
    from tierflow.exec import memory

    trims = []
    memory.return_free_memory = lambda: trims.append(rss_bytes())
    with caching_allocator(rss_bytes() + GUARD_MARGIN // 4):  # within the margin at once
        for _ in range(200):
            if trims:
                break
            time.sleep(0.005)
        assert len(trims) == 1
        time.sleep(0.05)
        assert len(trims) == 1  # the RSS did not grow: no more trims
    with caching_allocator(rss_bytes() + (1 << 40)):  # far from the level: none in the block
        time.sleep(0.05)
        assert len(trims) == 2  # the first block's own, at its end
    names = [t.name for t in threading.enumerate()]
    assert "tierflow-rss-guard-timing" not in names  # each block's guard ended with it


def test_a_guard_far_below_its_level_looks_less_often():
    """A guard looks at the RSS every millisecond only within reach of its margin: 1 GiB
    below it, it looks again once the RSS could have grown that far (at
    GUARD_FASTEST_GROWTH), at most GUARD_LONGEST apart. In a fresh process (it replaces
    the module's RSS reader)."""
    run_in_fresh_process("test_host_memory", "_guard_looks")


def _guard_looks() -> None:
    from tierflow.exec import memory

    looks = []
    memory.rss_bytes = lambda: looks.append(1) or 1 << 30  # a steady 1 GiB
    for above, fewest, most in ((GUARD_MARGIN + (1 << 30), 2, 8), (GUARD_MARGIN + MIB, 30, 400)):
        looks.clear()
        with caching_allocator((1 << 30) + above):
            time.sleep(0.2)
        assert fewest <= len(looks) <= most, (above, len(looks))


def test_rss_reads_what_the_kernel_says_and_a_child_reads_its_own():
    """rss_bytes keeps /proc/self/statm open; it reads the same as a fresh open of it, and
    a forked child reads its own RSS, not its parent's."""
    import os

    def fresh() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    assert abs(rss_bytes() - fresh()) < 8 * MIB  # the parent's reader is open from here
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child touches 128 MiB the parent has not; its reading goes up the pipe
        grown = bytearray(b"\1") * (128 * MIB)
        os.write(write, str(rss_bytes() - fresh()).encode())
        del grown
        os._exit(0)
    os.close(write)
    difference = int(os.read(read, 64))
    os.waitpid(pid, 0)
    assert abs(difference) < 8 * MIB  # the parent's RSS would read 128 MiB less


def test_fit_times_its_profile_under_the_ram_budget(monkeypatch):
    """``fit`` under a RAM budget times its profile rounds guarded at the budget's level (the
    RSS the budget does not cover, plus the budget). The process's profiles are forgotten
    first: a stage another test profiled in this process is not timed again."""
    import tierflow
    from tierflow.fitting import profile_step
    from tierflow.profile import profiler

    monkeypatch.setattr(profiler, "_CACHE", {})
    levels = []
    monkeypatch.setattr(profile_step, "caching_allocator",
                        lambda level=None: (levels.append(level), caching_allocator())[1])
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    tierflow.fit(model, torch.randn(8, 64), ram="1GiB")
    assert levels and all(level is not None and level > 1 << 30 for level in levels)


def test_only_the_last_guard_started_runs():
    first, second = HostRoom(limit=0), HostRoom(limit=0)
    first.start_guard(1 << 50)
    second.start_guard(1 << 50)
    for _ in range(200):
        names = [t.name for t in threading.enumerate()]
        if names.count("tierflow-rss-guard") == 1:
            break
        time.sleep(0.005)
    assert names.count("tierflow-rss-guard") == 1


def test_a_fitted_module_makes_room_for_work_outside_its_plan():
    """``module.make_room(n)`` (the trainer calls it before its optimizer's step) gives malloc's
    caches back when the RSS plus ``n`` would pass the plan's predicted peak, and does nothing
    without a RAM budget."""
    import tierflow

    def fitted(**budget):
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 1))
        return tierflow.fit(model, torch.randn(8, 64), **budget)

    module = fitted(ram="1GiB")
    room = module._host_room
    # its guard thread holds the RSS near the predicted peak (the process's RSS before fit
    # included): it would give the caches back first, in a process that holds more than
    # this test made, and make_room would find nothing to trim
    room.start_guard(1 << 50)
    cached = _cache_freed_blocks()
    trims = room.trims
    module.make_room(room.limit)  # whatever the RSS, this passes the predicted peak
    assert room.trims == trims + 1
    assert rss_bytes() < cached - 32 * MIB
    fitted().make_room(1 << 40)  # no budget: nothing to keep under


def test_a_module_given_another_plan_keeps_its_ram_guard():
    """``module.with_plan(plan)`` under a RAM budget: the new module's room has the limit of
    the new plan's predicted peak (the old limit moved by the difference), guards that
    prediction under the same budget, and its steps make room as the old module's do."""
    import tierflow
    from tierflow.plan.plan import Plan
    from tierflow.plan.strategies import checkpoint_all

    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                                      torch.nn.Linear(256, 64))
                                  for _ in range(4)])
    sample = torch.randn(1024, 64)  # keep-all holds each block's 1 MiB of hidden tape
    module = tierflow.fit(model, sample, ram="1GiB", planner="keep-all")
    costs = module.plan.costs
    other = module.with_plan(Plan("checkpoint-all", tuple(checkpoint_all(costs)), costs))
    old, new = module._host_room, other._host_room
    assert new is not None and new is not old
    assert new.limit - old.limit == other.plan.predicted_peak - module.plan.predicted_peak != 0
    assert new.guards_prediction and new.ceiling == old.ceiling is not None
    assert new.guard_level == min(new.limit + GUARD_MARGIN, new.ceiling)
    asked = []
    original = new.make_room
    new.make_room = lambda *args, **kw: (asked.append(args), original(*args, **kw))
    other(sample).sum().backward()
    assert asked  # before each operation that grows the RSS
