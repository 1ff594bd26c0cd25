"""The disk tier's file I/O: tensors of every size and alignment round-trip exactly, past the
page cache (O_DIRECT, where the file system allows it) and through it."""
from __future__ import annotations

import os

import pytest
import torch

from tierflow.core.errors import TierflowError
from tierflow.exec import file_io
from tierflow.exec.disk import DiskStore
from tierflow.exec.file_io import ALIGN, direct_io_supported, file_bytes

SIZES = [0, 1, 3, 1023, 1024, 1025, ALIGN // 4, ALIGN // 4 + 7, (3 << 20) // 4 + 5]


def _aligned(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An empty tensor whose memory starts at an ALIGN boundary."""
    nbytes = numel * dtype.itemsize
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    start = -raw.data_ptr() % ALIGN
    out = raw[start:start + nbytes].view(dtype)
    assert out.data_ptr() % ALIGN == 0
    return out


def _misaligned(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An empty tensor whose memory is 64 bytes past an ALIGN boundary."""
    return _aligned(numel + 64 // dtype.itemsize, dtype)[64 // dtype.itemsize:]


def _filled(make, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    t = make(numel, dtype)
    t.copy_(torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype))
    return t


def _modes(tmp_path) -> list[bool]:
    return [False, True] if direct_io_supported(tmp_path) else [False]


@pytest.mark.parametrize("write_make", [_aligned, _misaligned])
@pytest.mark.parametrize("read_make", [_aligned, _misaligned])
def test_tensors_round_trip_in_every_mode_and_alignment(tmp_path, write_make, read_make):
    for direct in _modes(tmp_path):
        store = DiskStore(tmp_path, direct=direct)
        dtypes = [torch.float32, torch.bfloat16, torch.int64]
        tensors = [_filled(write_make, n, dtypes[k % 3], k) for k, n in enumerate(SIZES)]
        store.write("mixed", tensors)
        back = [read_make(t.numel(), t.dtype) for t in tensors]
        store.read("mixed", back)
        for a, b in zip(tensors, back):
            assert torch.equal(a, b)
        assert store.sizes["mixed"] == file_bytes(tensors, direct)
        assert os.path.getsize(tmp_path / "mixed.bin") == file_bytes(tensors, direct)


def test_rewriting_a_key_with_less_replaces_the_file(tmp_path):
    for direct in _modes(tmp_path):
        store = DiskStore(tmp_path, direct=direct)
        store.write("k", [_filled(_aligned, 1 << 20, torch.float32, 1)])
        small = [_filled(_misaligned, 10, torch.float32, 2)]
        store.write("k", small)
        assert os.path.getsize(tmp_path / "k.bin") == file_bytes(small, direct)
        back = [torch.empty(10)]
        store.read("k", back)
        assert torch.equal(back[0], small[0])


def test_aligned_tensors_move_without_a_copy(tmp_path, monkeypatch):
    if not direct_io_supported(tmp_path):
        pytest.skip("no O_DIRECT on this file system")
    copied: list[int] = []
    memmove = file_io.ctypes.memmove

    def counting(dst, src, n):
        copied.append(n)
        return memmove(dst, src, n)

    monkeypatch.setattr(file_io.ctypes, "memmove", counting)
    store = DiskStore(tmp_path, direct=True)
    whole = _filled(_aligned, 4 * ALIGN, torch.float32, 3)  # whole blocks: no copy at all
    tail = _filled(_aligned, 4 * ALIGN + 3, torch.float32, 4)  # only the last 12 bytes
    store.write("w", [whole, tail])
    store.read("w", [_aligned(whole.numel()), _aligned(tail.numel())])
    assert copied == [12, 12]


def test_a_file_shorter_than_its_tensors_is_one_error(tmp_path):
    for direct in _modes(tmp_path):
        store = DiskStore(tmp_path, direct=direct)
        store.write("short", [torch.ones(100)])
        with pytest.raises(TierflowError, match="shorter than the tensors"):
            store.read("short", [torch.empty(100), torch.empty(100 + ALIGN)])


def test_pool_views_are_aligned_and_a_given_back_buffer_is_reused():
    from tierflow.exec.buffers import BufferPool
    pool = BufferPool(keep=1)
    shapes = [(torch.Size([3, 5]), torch.float32), (torch.Size([7]), torch.bfloat16),
              (torch.Size([2, 2]), torch.int64)]
    flat, views = pool.views(shapes)
    assert [(v.shape, v.dtype) for v in views] == shapes
    assert all((v.data_ptr() - flat.data_ptr()) % ALIGN == 0 for v in views)
    for k, v in enumerate(views):
        v.fill_(k + 1)
    assert all(bool((v == k + 1).all()) for k, v in enumerate(views))  # no overlaps
    pool.give(flat)
    again, _ = pool.views(shapes[:1])  # smaller: the free buffer fits
    assert again.data_ptr() == flat.data_ptr()
    bigger, _ = pool.views([(torch.Size([4 * ALIGN]), torch.float32)])
    assert bigger.data_ptr() != flat.data_ptr()  # too small to reuse: a new buffer
