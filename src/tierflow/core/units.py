"""Sizes and rates as text: byte strings (``"4GiB"``, ``"500MB"``, ``"0.5TiB"``, or a plain
integer of bytes) both ways, tokens per second, and the titled blocks of ``key : value`` rows
that the trainer and the simulator print. No torch."""
from __future__ import annotations

import math
from typing import Any

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
          "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_bytes(value: int | float | str, *, what: str = "budget") -> int:
    """Bytes from an int or a string such as ``"2GiB"``; ValueError names the value and the fix."""
    if isinstance(value, bool):
        raise ValueError(f"{what} {value!r} is not a size: give bytes or a string like '2GiB'")
    if isinstance(value, (int, float)):
        number, scale = float(value), 1
    else:
        text = str(value).strip().replace(" ", "").replace("_", "")
        split = len(text)
        while split > 0 and text[split - 1].isalpha():
            split -= 1
        unit = text[split:].upper()
        if unit not in _UNITS:
            raise ValueError(f"{what} {value!r} has an unknown unit {text[split:]!r}: "
                             f"use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB, e.g. '2GiB'")
        try:
            number = float(text[:split])
        except ValueError:
            raise ValueError(f"{what} {value!r} is not a size: use a number and a unit, "
                             f"e.g. '2GiB' or '500MB'") from None
        scale = _UNITS[unit]
    if not number > 0 or number != number or number == float("inf"):
        raise ValueError(f"{what} {value!r} must be a positive size, e.g. '2GiB'")
    return int(number * scale)


def format_bytes(n: int | float, *, round_up: bool = False) -> str:
    """Human-readable binary size: ``format_bytes(3 * 2**30) == '3.00 GiB'``. With
    ``round_up`` the figure is never below ``n`` (for "at least" messages a user copies)."""
    n = float(n)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            value = math.ceil(n / scale * 100) / 100 if round_up else n / scale
            return f"{value:.2f} {unit}"
    return f"{math.ceil(n) if round_up else int(n)} B"


def format_rate(tok_s: float) -> str:
    """``35.1k`` tokens per second (``k``/``M`` suffixes, three significant digits)."""
    if tok_s >= 1e6:
        return f"{tok_s / 1e6:.1f}M"
    if tok_s >= 1e3:
        return f"{tok_s / 1e3:.1f}k"
    return f"{tok_s:.0f}"


def section(title: str, rows: list[tuple[str, Any]]) -> str:
    """A printed block: ``[title]``, then one ``key : value`` line per row, keys aligned."""
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join([f"[{title}]"] + [f"  {k.ljust(width)} : {v}" for k, v in rows])


# what a budget stated from this run's measurements leaves for the next run's: the sizes
# measured before planning (RSS, runtime bytes) vary by up to about 1% between runs
_RERUN_FRACTION = 0.02
_RERUN_BYTES = 4 * 2**20


def with_rerun_margin(smallest: int) -> int:
    """A budget (bytes) for the next run after ``smallest`` (bytes, measured in this run) was
    found to be the least that works: 2% and 4 MiB more, for the measured sizes that vary
    between runs, rounded up to a whole MiB."""
    return math.ceil((smallest * (1 + _RERUN_FRACTION) + _RERUN_BYTES) / 2**20) * 2**20


def budget_to_give(smallest: int) -> str:
    """``with_rerun_margin(smallest)`` as a flag's value, e.g. ``"234MiB"``."""
    return f"{with_rerun_margin(smallest) // 2**20}MiB"


def format_margin(peak: int, budget: int) -> str:
    """The room between a predicted ``peak`` and its ``budget``: ``40.00 MiB (2.0% of the
    1.99 GiB budget)``, negative where the peak passes the budget."""
    room = budget - peak
    return (f"{'-' if room < 0 else ''}{format_bytes(abs(room))} ({room / budget:.1%} of the "
            f"{format_bytes(budget)} budget)")


LARGEST_BARE_GIB = 2**20  # from here on a bare number is bytes that lost their unit


def size_with_unit(text: str, flag: str) -> str:
    """A memory size as every command reads it: a bare number is GiB and gets its unit
    (``"64"`` is ``"64GiB"``), a byte string is kept; ValueError naming ``flag``, the value
    and the fix when it is no positive size or a bare number of ``LARGEST_BARE_GIB`` or more
    (read as GiB, more memory than a machine has: a count of bytes without its unit)."""
    text = str(text).strip()
    try:
        number = float(text)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):  # a byte string (or no size: parse_bytes says what to write)
        parse_bytes(text, what=flag)
        return text
    if number >= LARGEST_BARE_GIB:
        raise ValueError(f"{flag} {text}: a bare number is GiB and must be below "
                         f"{LARGEST_BARE_GIB}; for {format_bytes(number)} write {text}B, "
                         "or a size with its unit like 4GiB")
    if not number > 0:
        raise ValueError(f"{flag} {text!r} must be a positive size, e.g. '2GiB'")
    return f"{text}GiB"
