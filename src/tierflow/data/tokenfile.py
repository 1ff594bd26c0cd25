"""Token files: a 64-byte header, then the tokens, little-endian.

Header (little-endian): magic ``b"TFTOKENS"`` (8 bytes), format version (uint32), bytes per
token (uint32: 2 or 4), token count (uint64), vocab size (uint64), then in version 2 the
document count (uint64) and flags (uint32: bit 0, a loss mask follows), zero padding to 64
bytes. Tokens are uint16 when the vocab has at most 65536 ids, else uint32. The header lets a
reader refuse a truncated or foreign file with a clear message instead of training on garbage.

Version 2 (written since fine-tuning data) appends, each section starting on an 8-byte
boundary: the loss mask when flagged (one uint8 per token: 1 where the token is a target, the
answers of a chat or completion record; 0 where it is context only), then the document
boundaries (document count + 1 uint64 offsets, the first 0, the last the token count).
Version 1 files (tokens only) still read: no mask, no boundaries.

nanoGPT's ``.bin`` files (raw uint16, no header) are read too: a file without the magic is
taken as one, unless its first 8 bytes are printable text (another format's magic, or a text
file), which is refused as a wrong magic; ``headerless=True`` forces the nanoGPT reading.

Training reads a file with ``pread`` into fresh arrays and drops what it read from the page
cache, never through the memory map: mapped pages that were touched count in the process's
RSS, so a scan of a 10 GB corpus through the map would hold 10 GB against ``--ram``.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import BinaryIO, Iterable, Sequence

import numpy as np

from ..core.errors import TierflowError
from ..core.page_cache import drop_from_page_cache

MAGIC = b"TFTOKENS"
VERSION = 2
READS = (1, 2)  # the format versions this tierflow reads
HEADER_BYTES = 64
_HEADER = struct.Struct("<8sIIQQ")  # magic, version, bytes per token, token count, vocab size
_HEADER_V2 = struct.Struct("<8sIIQQQI")  # ..., document count, flags
MASKED = 1  # flag: a loss mask follows the tokens
_CHUNK = 1 << 22  # tokens per chunk when scanning or buffering (8-16 MiB)
_REWRITE = "rewrite it with 'tierflow tokenize'"


def dtype_for_vocab(vocab_size: int | None) -> np.dtype:
    """uint16 when every id fits (vocab <= 65536), else uint32: the smallest exact type."""
    if vocab_size is not None and vocab_size > 1 << 16:
        return np.dtype("<u4")
    return np.dtype("<u2")


# ---------------------------------------------------------------- writing

class TokenWriter:
    """Streams tokens to ``path`` through a temporary file; ``commit()`` makes it appear whole.

    The file is written as ``.NAME.tmp-PID`` beside ``path``, the header is rewritten with the
    final count, then fsync and rename: a reader never sees a half-written token file.
    Use as a context manager: leaving the block normally commits, an exception discards.
    """

    def __init__(self, path: str | os.PathLike[str], vocab_size: int, masked: bool = False):
        if vocab_size < 1:
            raise TierflowError(f"vocab size {vocab_size} for token file {path} must be at least 1")
        self.path = Path(path)
        self.vocab_size = int(vocab_size)
        self.dtype = dtype_for_vocab(vocab_size)
        self.masked = masked
        self.count = 0
        self.ends: list[int] = []  # the token offset where each finished document ends
        self._tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self._file = open(self._tmp, "wb")
        self._mask = open(self._tmp.with_name(self._tmp.name + ".mask"), "w+b") if masked else None
        self._file.write(self._header(0))

    def _header(self, count: int) -> bytes:
        head = _HEADER_V2.pack(MAGIC, VERSION, self.dtype.itemsize, count, self.vocab_size,
                               len(self.ends), MASKED if self.masked else 0)
        return head.ljust(HEADER_BYTES, b"\0")

    def write(self, tokens: Sequence[int] | np.ndarray, mask: np.ndarray | None = None,
              end_document: bool = True) -> None:
        """Append ``tokens``, ids in [0, vocab size) (an id out of range is a TierflowError),
        with their loss ``mask`` (1: a target; a masked writer without one counts every token);
        ``end_document``: a document ends after them (else the next write continues it)."""
        array = np.asarray(tokens)
        if mask is not None and (self._mask is None or np.shape(mask) != array.shape):
            raise TierflowError(f"a loss mask of shape {np.shape(mask)} for {array.shape} tokens "
                                f"cannot be written to {self.path}; fix: one mask value per "
                                f"token, in a writer made with masked=True")
        if array.size == 0:
            return
        low, high = int(array.min()), int(array.max())
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise TierflowError(f"token id {bad} cannot be written to {self.path}: ids must be in "
                                f"[0, {self.vocab_size}) for vocab size {self.vocab_size}; fix: "
                                f"pass the tokenizer's full vocab size (added tokens included)")
        self._file.write(array.astype(self.dtype, copy=False).tobytes())
        if self._mask is not None:
            ones = np.ones(array.size, np.uint8) if mask is None else mask
            self._mask.write(np.asarray(ones, dtype=np.uint8).reshape(-1).tobytes())
        self.count += int(array.size)
        if end_document:
            self.ends.append(self.count)

    def commit(self) -> int:
        """Append the mask and the boundaries, write the final header, fsync, rename onto
        ``path``; returns the token count."""
        if self.count > (self.ends[-1] if self.ends else 0):
            self.ends.append(self.count)  # the open document ends with the file
        if self._mask is not None:
            self._pad()
            self._mask.seek(0)
            while chunk := self._mask.read(_CHUNK):
                self._file.write(chunk)
        self._pad()
        self._file.write(np.asarray([0, *self.ends], dtype="<u8").tobytes())
        self._file.seek(0)
        self._file.write(self._header(self.count))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._close()
        os.replace(self._tmp, self.path)
        _fsync_dir(self.path.parent)
        return self.count

    def _pad(self) -> None:
        """Zeros up to the next 8-byte boundary: every section starts aligned."""
        self._file.write(b"\0" * (-self._file.tell() % 8))

    def _close(self) -> None:
        self._file.close()
        if self._mask is not None:
            self._mask.close()
            Path(self._mask.name).unlink(missing_ok=True)

    def discard(self) -> None:
        """Close and delete the temporary files; ``path`` is left as it was."""
        self._close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> "TokenWriter":
        return self

    def __exit__(self, exc_type: type | None, *rest: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()


def write_tokens(path: str | os.PathLike[str], tokens: np.ndarray | Iterable[int] |
                 Iterable[Sequence[int]], vocab_size: int) -> int:
    """Write a token file atomically; returns the token count.

    ``tokens`` is an array, an iterable of ids, or an iterable of chunks (arrays or lists),
    written as one document without a mask.
    """
    with TokenWriter(path, vocab_size) as writer:
        for chunk in _chunks(tokens):
            writer.write(chunk, end_document=False)
    return writer.count


def _chunks(tokens: np.ndarray | Iterable[int] | Iterable[Sequence[int]]) -> Iterable[np.ndarray]:
    """Arrays of ids from an array, an iterable of ids or an iterable of chunks."""
    if isinstance(tokens, np.ndarray):
        yield tokens.reshape(-1)
        return
    pending: list[int] = []
    for item in tokens:
        if isinstance(item, (int, np.integer)):
            pending.append(int(item))
            if len(pending) >= _CHUNK:
                yield np.asarray(pending, dtype=np.int64)
                pending = []
        else:
            if pending:
                yield np.asarray(pending, dtype=np.int64)
                pending = []
            yield np.asarray(item, dtype=np.int64).reshape(-1)
    if pending:
        yield np.asarray(pending, dtype=np.int64)


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable; some file systems cannot open a directory, which is harmless."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------- reading

class TokenFile:
    """A read-only token file: ``len(f)`` tokens, memory-mapped as ``f.tokens`` for callers
    that want an array; ``window`` and ``max_token`` read the file instead (see the module's
    docstring).

    ``vocab_size`` is None for a nanoGPT file unless the caller gave it. Open with
    :meth:`open`, which validates the header and the size against the count.
    """

    def __init__(self, path: Path, tokens: np.ndarray, vocab_size: int | None, headerless: bool,
                 mask: np.ndarray | None = None, offsets: np.ndarray | None = None,
                 version: int = 1):
        self.path = path
        self.tokens = tokens
        self.vocab_size = vocab_size
        self.headerless = headerless
        self.mask = mask  # (tokens,) uint8, 1 where a token is a target; None: every token
        self.offsets = offsets  # (documents + 1,) uint64 boundaries; None: unknown (v1)
        self.version = version
        self._first_byte = 0 if headerless else HEADER_BYTES

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, vocab_size: int | None = None,
             headerless: bool | None = None) -> "TokenFile":
        """Map ``path``. ``headerless``: None detects, True forces nanoGPT's raw uint16.

        ``vocab_size`` names the vocab of a headerless file; a tierflow file's comes from its
        header (check ids against a model's vocab with :meth:`check_vocab`). Each problem is a
        TierflowError naming the file, what is wrong and the fix.
        """
        path = Path(path)
        size = _file_size(path)
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
        if headerless is None:
            headerless = not head.startswith(MAGIC)
            if headerless and _looks_like_text(head):
                raise TierflowError(
                    f"token file {path} has the wrong magic {head[:8]!r} (expected {MAGIC!r}): it "
                    f"is not a tierflow token file; fix: {_REWRITE}, or open a nanoGPT uint16 "
                    f".bin with headerless=True")
        if headerless:
            return cls._open_headerless(path, size, vocab_size)
        return cls._open_tierflow(path, size, head)

    @classmethod
    def _open_headerless(cls, path: Path, size: int, vocab_size: int | None) -> "TokenFile":
        if size % 2:
            raise TierflowError(f"token file {path} is truncated: {size} bytes is not a whole "
                                f"number of uint16 tokens (nanoGPT format, no header); fix: "
                                f"regenerate the file")
        return cls(path, _map(path, np.dtype("<u2"), 0, size // 2), vocab_size, headerless=True)

    @classmethod
    def _open_tierflow(cls, path: Path, size: int, head: bytes) -> "TokenFile":
        if len(head) < _HEADER.size:
            raise TierflowError(f"token file {path} is truncated: {size} bytes, shorter than its "
                                f"{HEADER_BYTES}-byte header; fix: {_REWRITE}")
        _, version, width, count, header_vocab = _HEADER.unpack_from(head)
        if version not in READS:
            raise TierflowError(f"token file {path} has format version {version}, but this "
                                f"tierflow reads versions {', '.join(map(str, READS))}; fix: "
                                f"{_REWRITE} (or use the tierflow that wrote it)")
        if width not in (2, 4) or width != dtype_for_vocab(header_vocab).itemsize:
            raise TierflowError(f"token file {path} has a corrupt header: {width} bytes per token "
                                f"for vocab size {header_vocab}; fix: {_REWRITE}")
        documents, flags = _HEADER_V2.unpack_from(head)[5:] if version >= 2 else (0, 0)
        end = HEADER_BYTES + count * width
        mask_at = _aligned(end) if flags & MASKED else None
        if mask_at is not None:
            end = mask_at + count
        offsets_at = _aligned(end) if version >= 2 else None
        expected = end if offsets_at is None else offsets_at + (documents + 1) * 8
        if size != expected:
            what = "is truncated" if size < expected else "has trailing bytes"
            raise TierflowError(f"token file {path} {what}: its header promises {count} tokens "
                                f"({expected} bytes) but it holds {size} bytes; fix: {_REWRITE}")
        tokens = _map(path, np.dtype(f"<u{width}"), HEADER_BYTES, count)
        mask = None if mask_at is None else _map(path, np.dtype("u1"), mask_at, count)
        offsets = None
        if offsets_at is not None:
            offsets = np.fromfile(path, dtype="<u8", count=documents + 1, offset=offsets_at)
            steps = np.diff(offsets.astype(np.int64))  # (documents,) lengths
            if offsets[0] != 0 or offsets[-1] != count or np.any(steps < 0):
                raise TierflowError(f"token file {path} has corrupt document boundaries; fix: "
                                    f"{_REWRITE}")
        return cls(path, tokens, int(header_vocab), headerless=False, mask=mask,
                   offsets=offsets, version=int(version))

    @property
    def documents(self) -> int | None:
        """The number of documents (None in a version-1 or nanoGPT file, which do not say)."""
        return None if self.offsets is None else len(self.offsets) - 1

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def bytes_per_token(self) -> int:
        return int(self.tokens.dtype.itemsize)

    def max_token(self) -> int | None:
        """The largest id in the file (None when empty), read in chunks into one buffer. The
        result is remembered for this file's identity and modification time: the command line's
        check before importing torch and the run both ask for it."""
        if len(self) == 0:
            return None
        stat = self.path.stat()
        key = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if key not in _MAX_TOKEN:
            buffer = np.empty(min(_CHUNK, len(self)), dtype=self.tokens.dtype)
            top = 0
            with open(self.path, "rb", buffering=0) as f:
                for start in range(0, len(self), _CHUNK):
                    chunk = buffer[:min(_CHUNK, len(self) - start)]
                    self._read_into(f, start, chunk)
                    top = max(top, int(chunk.max()))
                drop_from_page_cache(f.fileno(), 0, stat.st_size)
            _MAX_TOKEN[key] = top
        return _MAX_TOKEN[key]

    def check_vocab(self, vocab_size: int | None = None) -> None:
        """Raise TierflowError if an id is >= ``vocab_size`` (default: the file's own vocab).

        Cheap insurance before training: an out-of-range id would otherwise index past the
        embedding table (an opaque crash or, on some devices, silent garbage).
        """
        limit = self.vocab_size if vocab_size is None else vocab_size
        if limit is None:
            raise TierflowError(f"token file {self.path} has no header, so its vocab size is "
                                f"unknown; fix: give the vocab size of the tokenizer that wrote it")
        top = self.max_token()
        if top is not None and top >= limit:
            raise TierflowError(f"token file {self.path} holds token id {top}, which is >= the "
                                f"vocab size {limit}; fix: tokenize with the model's tokenizer "
                                f"or use a model whose vocab has at least {top + 1} ids")

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` as a fresh int64 array (not a view of the map)."""
        return self.windows([start], length)[0]

    def windows(self, starts: Sequence[int], length: int) -> np.ndarray:
        """The windows of ``length`` tokens from each of ``starts``, as a fresh
        (len(starts), length) int64 array, read through one open of the file."""
        for start in starts:
            if start < 0 or length < 0 or start + length > len(self):
                raise TierflowError(f"token file {self.path} holds {len(self)} tokens; the "
                                    f"window [{start}, {start + length}) is outside it; fix: use "
                                    f"a shorter sequence length or more data")
        out = np.empty((len(starts), length), dtype=self.tokens.dtype)  # (rows, length)
        with open(self.path, "rb", buffering=0) as f:
            for row, start in zip(out, starts):
                first = self._read_into(f, int(start), row)
                drop_from_page_cache(f.fileno(), first, row.nbytes)
        return out.astype(np.int64)

    def _read_into(self, f: BinaryIO, start: int, out: np.ndarray) -> int:
        """Fill ``out`` with the tokens from ``start`` on, read from ``f`` (this file, opened
        unbuffered); returns the byte offset read from."""
        first = self._first_byte + start * self.bytes_per_token
        view = memoryview(out).cast("B")
        f.seek(first)
        done = 0
        while done < len(view):
            got = f.readinto(view[done:])
            if not got:
                raise TierflowError(f"token file {self.path} ended while reading it: it was "
                                    f"truncated while in use; fix: {_REWRITE}")
            done += got
        return first

    def __repr__(self) -> str:
        kind = "nanoGPT uint16" if self.headerless else f"v{self.version}"
        return (f"TokenFile({str(self.path)!r}, {len(self)} tokens, {kind}, "
                f"vocab_size={self.vocab_size})")


def _file_size(path: Path) -> int:
    """The size of a regular, readable file, or a TierflowError saying what is wrong."""
    try:
        if not path.is_file():
            what = "is a directory" if path.is_dir() else "does not exist"
            raise TierflowError(f"token file {path} {what}; fix: give the path of a .bin file "
                                f"written by 'tierflow tokenize'")
        if not os.access(path, os.R_OK):
            raise TierflowError(f"token file {path} is not readable; fix: check its permissions")
        return path.stat().st_size
    except OSError as err:
        raise TierflowError(f"cannot read token file {path}: {err.strerror}") from None


def _aligned(offset: int) -> int:
    """``offset`` rounded up to a multiple of 8, where each section after the tokens starts."""
    return offset + (-offset % 8)


def _map(path: Path, dtype: np.dtype, offset: int, count: int) -> np.ndarray:
    """A read-only memmap of ``count`` tokens; numpy cannot map zero bytes, so empty is an array."""
    if count == 0:
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))


_MAX_TOKEN: dict[tuple[int, int, int, int], int] = {}  # (device, inode, size, mtime) -> id


def _looks_like_text(head: bytes) -> bool:
    """True when the first 8 bytes are printable ASCII: a magic or a text file, not uint16 ids."""
    return len(head) >= 8 and all(32 <= b < 127 or b in b"\t\r\n" for b in head[:8])
