"""The numba kernels behind `dataplane.memory.rope_kernel` (imported only when they are wanted:
numba takes half a second to import). Arrays are bfloat16 bits (uint16) or float32; indices
are unsigned, so numba emits no negative-index wraparound and the loops vectorize."""

# mypy: ignore-errors
from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload


@intrinsic
def _f32_of(typingctx: Any, u: Any) -> Any:
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def _bits_of(typingctx: Any, f: Any) -> Any:
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


def load(x):
    """An element as float32."""


def store(f, like):
    """A float32 as an element of ``like``'s type (bfloat16: round to nearest even)."""


@overload(load, inline="always")
def _load(x):
    if x == types.uint16:
        return lambda x: _f32_of(np.uint32(np.uint32(x) << np.uint32(16)))
    return lambda x: np.float32(x)


@overload(store, inline="always")
def _store(f, like):
    if like == types.uint16:

        def to_bf16(f, like):
            v = _bits_of(f)
            if (v & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # NaN stays a (quiet) NaN
                return np.uint16(np.uint32(v | np.uint32(0x00400000)) >> np.uint32(16))
            w = np.uint32(v + np.uint32(0x7FFF) + ((v >> np.uint32(16)) & np.uint32(1)))  # to nearest even
            return np.uint16(w >> np.uint32(16))

        return to_bf16
    return lambda f, like: np.float32(f)


@njit(nogil=True, cache=True, boundscheck=False, fastmath={"contract"})
def rotate_rows(src, src_rows, dst, dst_rows, cos, sin, heads, head_dim, rd, neox):
    half, hd, r0 = np.uint64(rd // 2), np.uint64(head_dim), np.uint64(rd)
    one = np.uint64(1)
    for t in range(src_rows.shape[0]):
        s, d = src[src_rows[t]], dst[dst_rows[t]]
        for h in range(np.uint64(heads)):
            sa, da = s[h * hd : h * hd + hd], d[h * hd : h * hd + hd]
            if neox:
                for i in range(half):
                    a, b = load(sa[i]), load(sa[half + i])
                    da[i] = store(a * cos[i] - b * sin[i], sa[i])
                    da[half + i] = store(b * cos[i] + a * sin[i], sa[i])
            else:
                for i in range(half):
                    a, b = load(sa[i + i]), load(sa[i + i + one])
                    da[i + i] = store(a * cos[i] - b * sin[i], sa[i])
                    da[i + i + one] = store(b * cos[i] + a * sin[i], sa[i])
            for j in range(r0, hd):
                da[j] = sa[j]


@njit(nogil=True, cache=True, boundscheck=False)
def copy_rows(src, src_rows, dst, dst_rows):
    n = np.uint64(src.shape[1])
    for t in range(src_rows.shape[0]):
        s, d = src[src_rows[t]], dst[dst_rows[t]]
        for j in range(n):
            d[j] = s[j]


def compile_all() -> dict[str, Any]:
    """Every dtype and style compiled (or loaded from the cache) now, so no transfer waits."""
    for bits in (np.uint16, np.float32):
        a = np.zeros((2, 4), dtype=bits)
        rows = np.arange(2, dtype=np.int64)
        cs = np.ones(1, dtype=np.float32)
        for neox in (True, False):
            rotate_rows(a, rows, a.copy(), rows, cs, cs, 2, 2, 2, neox)
        copy_rows(a, rows, a.copy(), rows)
    return {"rotate_rows": rotate_rows, "copy_rows": copy_rows}
