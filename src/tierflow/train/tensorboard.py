"""TensorBoard event files for ``tierflow train --tensorboard DIR``, with no dependency.

An event file is a sequence of TFRecords; each record is

    uint64 length (little-endian) | uint32 masked CRC32C of those 8 bytes |
    data (length bytes)           | uint32 masked CRC32C of data

where the data is a serialized ``tensorflow.Event`` protobuf. Only what scalars need is
encoded here:

    Event   { double wall_time = 1; int64 step = 2; string file_version = 3;
              Summary summary = 5; }
    Summary { repeated Value value = 1; }
    Value   { string tag = 1; float simple_value = 2; }

The first record carries ``file_version = "brain.Event:2"``. The file is named
``events.out.tfevents.<unix time>.<host>`` as TensorBoard expects, and every record is flushed
as it is written, so ``tensorboard --logdir DIR`` shows a run while it trains.
"""
from __future__ import annotations

import socket
import struct
import time
from pathlib import Path
from typing import Mapping

from ..core.errors import TierflowError

FILE_VERSION = "brain.Event:2"


# ---------------------------------------------------------------- CRC32C (Castagnoli)

def _crc_table() -> list[int]:
    poly = 0x82F63B78  # 0x1EDC6F41 bit-reversed
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ poly if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    table = _TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# ---------------------------------------------------------------- protobuf encoding

def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64 negatives: ten-byte two's complement
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint((field << 3) | wire_type)


def _bytes_field(field: int, data: bytes) -> bytes:
    return _key(field, 2) + _varint(len(data)) + data


def encode_value(tag: str, value: float) -> bytes:
    return _bytes_field(1, tag.encode("utf-8")) + _key(2, 5) + struct.pack("<f", value)


def encode_event(wall_time: float, step: int, *, file_version: str | None = None,
                 scalars: Mapping[str, float] | None = None) -> bytes:
    data = _key(1, 1) + struct.pack("<d", wall_time) + _key(2, 0) + _varint(int(step))
    if file_version is not None:
        data += _bytes_field(3, file_version.encode("utf-8"))
    if scalars is not None:
        summary = b"".join(_bytes_field(1, encode_value(tag, float(v)))
                           for tag, v in scalars.items())
        data += _bytes_field(5, summary)
    return data


def record(data: bytes) -> bytes:
    """One TFRecord around ``data``."""
    length = struct.pack("<Q", len(data))
    return (length + struct.pack("<I", masked_crc32c(length)) + data
            + struct.pack("<I", masked_crc32c(data)))


# ---------------------------------------------------------------- the writer

class EventWriter:
    """Appends scalar events to a new ``events.out.tfevents.*`` file in ``logdir``."""

    def __init__(self, logdir: str | Path):
        self.logdir = Path(logdir)
        now = time.time()
        host = socket.gethostname() or "localhost"
        name = f"events.out.tfevents.{int(now)}.{host}"
        try:
            self.logdir.mkdir(parents=True, exist_ok=True)
            self.path = self.logdir / name
            n = 1
            while self.path.exists():  # two runs in the same second
                self.path = self.logdir / f"{name}.{n}"
                n += 1
            self.file = open(self.path, "wb")
            self._write(encode_event(now, 0, file_version=FILE_VERSION))
        except OSError as e:
            raise TierflowError(f"--tensorboard {self.logdir} is not writable "
                                f"({e.strerror or e}): choose a directory you can write to") from None

    def _write(self, data: bytes) -> None:
        self.file.write(record(data))
        self.file.flush()

    def scalars(self, step: int, values: Mapping[str, float | None]) -> None:
        """One event at ``step`` with every value that is a finite-or-not number (None is
        left out). A write error (a full disk) turns TensorBoard output off, never the run."""
        shown = {k: float(v) for k, v in values.items() if v is not None}
        if not shown or self.file is None:
            return
        try:
            self._write(encode_event(time.time(), step, scalars=shown))
        except OSError:
            self.close()

    def close(self) -> None:
        if self.file is not None:
            try:
                self.file.close()
            except OSError:
                pass
            self.file = None
