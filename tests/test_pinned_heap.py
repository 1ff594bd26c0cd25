"""The page-locked heap of the RAM tier below a GPU (exec/pinned.py), carved from pageable
segments here (``pin=False``): the carving is the same on a GPU machine."""
from __future__ import annotations

import threading

import pytest
import torch

from tierflow.exec.pinned import ALIGN, PinnedHeap

MIB = 1 << 20


def test_tensors_carved_from_the_heap_never_overlap_and_hold_their_values():
    heap = PinnedHeap(pin=False, segment_bytes=64 * MIB)
    shapes = [((1024, 1024), torch.bfloat16), ((3, 5), torch.float32), ((7,), torch.int64),
              ((2048, 1000), torch.float32), ((1,), torch.uint8)]
    tensors = [heap.empty(shape, dtype) for shape, dtype in shapes]
    for k, t in enumerate(tensors):
        assert t.shape == torch.Size(shapes[k][0]) and t.dtype == shapes[k][1]
        assert t.data_ptr() % ALIGN == 0
        t.fill_(k + 1)
    for k, t in enumerate(tensors):
        assert bool((t == k + 1).all())
    assert heap.used_bytes >= sum(t.nbytes for t in tensors)


def test_segments_are_powers_of_two_that_double_up_to_the_cap():
    heap = PinnedHeap(pin=False, segment_bytes=16 * MIB)
    for _ in range(20):
        heap.empty((3 * MIB,), torch.uint8)  # 3 MiB each: 60 MiB in all
    sizes = [s.numel() for s in heap._segments]
    assert all(size & (size - 1) == 0 for size in sizes)
    assert sizes[0] == 4 * MIB and max(sizes) == 16 * MIB
    assert sizes == sorted(sizes)
    # first fit: every segment but the last is full but for less than one more tensor
    free = [sum(size for _, size in ranges) for ranges in heap._free]
    assert all(f < 3 * MIB for f in free[:-1])


def test_a_tensor_larger_than_the_cap_gets_a_segment_of_its_own():
    heap = PinnedHeap(pin=False, segment_bytes=4 * MIB)
    big = heap.empty((5 * MIB,), torch.uint8)
    assert big.numel() == 5 * MIB and heap.reserved_bytes == 8 * MIB
    small = heap.empty((MIB,), torch.uint8)  # fits the big one's free end
    assert heap.reserved_bytes == 8 * MIB and small.numel() == MIB


def test_freed_ranges_merge_and_are_reused():
    heap = PinnedHeap(pin=False, segment_bytes=8 * MIB)
    heap.free(heap.empty((8 * MIB,), torch.uint8))  # one free segment of 8 MiB
    a, b, c = (heap.empty((2 * MIB,), torch.uint8) for _ in range(3))
    reserved = heap.reserved_bytes
    heap.free(a)
    heap.free(b)  # a and b merge into one 4 MiB range
    d = heap.empty((4 * MIB,), torch.uint8)
    assert d.data_ptr() == a.data_ptr() and heap.reserved_bytes == reserved
    assert heap.owns(d)
    heap.free(c)
    heap.free(d)
    assert heap.used_bytes == 0
    with pytest.raises(KeyError):
        heap.free(c)


def test_a_segment_size_that_is_no_power_of_two_is_refused():
    with pytest.raises(ValueError, match="power of two"):
        PinnedHeap(pin=False, segment_bytes=3 * MIB)


def test_threads_carve_and_free_at_once_without_sharing_a_byte():
    heap = PinnedHeap(pin=False, segment_bytes=8 * MIB)
    failures = []

    def work(k: int) -> None:
        for _ in range(50):
            t = heap.empty((64 * 1024 + k,), torch.uint8)
            t.fill_(k)
            if not bool((t == k).all()):
                failures.append(k)
            heap.free(t)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(1, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures and heap.used_bytes == 0


def test_the_ram_tier_keeps_its_copies_in_the_heap_and_gives_them_back():
    """HostStore on a GPU machine: its copies carved from the heap, a rewrite of another shape
    and a discard giving their ranges back (pageable here, page-locked there)."""
    from tierflow.exec.host_store import HostStore

    store = HostStore("cpu")
    store._heap = PinnedHeap(pin=False, segment_bytes=8 * MIB)
    weights = [torch.randn(256, 128), torch.randn(64)]
    store.write("w", weights)
    assert all(store._heap.owns(t) for t in store.entries("w"))
    out = [torch.empty_like(t) for t in weights]
    store.read("w", out)
    assert all(torch.equal(a, b) for a, b in zip(out, weights))
    used = store._heap.used_bytes
    store.write("w", [torch.ones(10)])  # another shape: the old copies go back to the heap
    assert store._heap.used_bytes < used and store.bytes == 40
    store.discard("w")
    assert store._heap.used_bytes == 0 and store.bytes == 0
