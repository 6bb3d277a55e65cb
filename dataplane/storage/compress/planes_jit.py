"""The numba kernels behind `planes` (imported only when they are compiled: numba takes half a
second to import): a chunk's 16-bit words split into their two byte planes, and joined back,
each in one pass over memory (numpy needs two passes with a strided copy: 4-5 GB/s here, the
kernels near memcpy's speed)."""

# mypy: ignore-errors
from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit


@njit(nogil=True, cache=True, boundscheck=False)
def join(high, low, words):
    """words[i] = high[i] << 8 | low[i]"""
    eight = np.uint16(8)
    for i in range(words.size):
        words[i] = (np.uint16(high[i]) << eight) | np.uint16(low[i])


@njit(nogil=True, cache=True, boundscheck=False)
def split(words, high, low):
    """high[i], low[i] = words[i] >> 8, words[i] & 0xFF"""
    eight, mask = np.uint16(8), np.uint16(0xFF)
    for i in range(words.size):
        w = words[i]
        high[i] = np.uint8(w >> eight)
        low[i] = np.uint8(w & mask)


def compile_all() -> dict[str, Any]:
    """Both kernels compiled (or loaded from numba's cache) for every kind of array the codec
    hands them (read-only views of received bytes, writable buffers), then closed to further
    compiling: an array of another kind raises TypeError, and the caller takes numpy's path
    instead of compiling on a reader's thread."""
    for ro_high in (False, True):
        for ro_low in (False, True):
            high, low, words = np.zeros(2, np.uint8), np.zeros(2, np.uint8), np.zeros(2, np.uint16)
            high.flags.writeable = not ro_high
            low.flags.writeable = not ro_low
            join(high, low, words)
    for ro_words in (False, True):
        words = np.zeros(2, np.uint16)
        words.flags.writeable = not ro_words
        split(words, np.zeros(2, np.uint8), np.zeros(2, np.uint8))
    join.disable_compile()
    split.disable_compile()
    return {"join": join, "split": split}
