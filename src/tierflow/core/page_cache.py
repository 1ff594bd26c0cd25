"""Dropping a file's bytes from the OS page cache (torch-free: token files use it before the
command line imports torch). Read or written data left there would fill the RAM a budget gave
to training; where the OS has no ``posix_fadvise`` it stays."""
from __future__ import annotations

import os


def drop_from_page_cache(fd: int, first: int = 0, length: int = 0) -> None:
    """Drop bytes ``[first, first + length)`` of ``fd`` from the page cache (``length`` 0: to
    the end of the file), where the OS can."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, first, length, os.POSIX_FADV_DONTNEED)
