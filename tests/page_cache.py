"""A file out of the page cache, checked: what the cold-read tests of the file tier start from."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

from tests.helpers import wait_until

_LIBC = ctypes.CDLL(None, use_errno=True)


def drop_from_page_cache(path: str | Path) -> None:
    """``path`` out of the page cache, checked page by page (``POSIX_FADV_DONTNEED`` may leave a
    page another CPU still holds): asked again until none is resident, within a deadline."""

    def dropped() -> bool:
        with open(path, "rb") as f:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        return resident_pages(path) == 0

    wait_until(dropped, 5, 0.01, what=f"{path} out of the page cache")


def resident_pages(path: str | Path) -> int:
    """How many of ``path``'s pages the page cache holds (mincore over a mapping never touched)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
        view = (ctypes.c_char * size).from_buffer(m)
        try:
            if _LIBC.mincore(ctypes.c_void_p(ctypes.addressof(view)), ctypes.c_size_t(size), vec):
                raise OSError(ctypes.get_errno(), "mincore failed")
        finally:
            del view
        return sum(v & 1 for v in vec)
    finally:
        m.close()
