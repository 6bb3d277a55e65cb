"""Compiled blend copies (numba): rows of a KV cache moved between two tensors in one pass, the
keys rotated on the way.

``rotate_rows(src, src_rows, dst, dst_rows, cos, sin, heads, head_dim, rotary_dim, neox)``
writes row ``src_rows[t]`` of ``src`` ([rows, heads * head_dim], contiguous) into row
``dst_rows[t]`` of ``dst``, each head's pairs rotated by the angle whose cos and sin are given
([rotary_dim / 2] float32) and the features past ``rotary_dim`` copied. ``copy_rows`` moves the
values the same way, untouched. The arithmetic is float32, rounded once to the tensor's dtype
(bfloat16, round to nearest even, as torch does; float32). Reading, rotating and writing a row
while it is in cache costs little more than the copy itself; the same in torch takes a dozen
passes over memory.

Compiled on first use (about a second per dtype and style; cached on disk when the package
directory is writable): `KernelWarmup` compiles them on a thread of its own, and callers use
torch until ``ready``. Other dtypes (float16: numba has no half type) and CUDA tensors are not
handled here (``supported`` says False).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dataplane.memory.jit import CompileWarmup

_BITS = {torch.bfloat16: np.uint16, torch.float32: np.float32}
_kernels: dict[str, Any] = {}  # name -> compiled function; filled once by _compile()


def compiled() -> bool:
    """Whether this process has the kernels (any `KernelWarmup` of it finished compiling)."""
    return bool(_kernels)


def supported(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in _BITS


def _as_array(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _compile() -> dict[str, Any]:
    from dataplane.memory import rope_jit  # numba: imported only now

    return rope_jit.compile_all()


def rotate_rows(
    src: torch.Tensor,
    src_rows: np.ndarray,
    dst: torch.Tensor,
    dst_rows: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    heads: int,
    head_dim: int,
    rotary_dim: int,
    neox: bool,
) -> None:
    """See the module docstring; `KernelWarmup.ready` first. Releases the GIL."""
    _kernels["rotate_rows"](
        _as_array(src), src_rows, _as_array(dst), dst_rows, cos, sin, heads, head_dim, rotary_dim, neox
    )


def copy_rows(src: torch.Tensor, src_rows: np.ndarray, dst: torch.Tensor, dst_rows: np.ndarray) -> None:
    _kernels["copy_rows"](_as_array(src), src_rows, _as_array(dst), dst_rows)


class KernelWarmup(CompileWarmup):
    """Compiles the kernels on thread ``kvwarden-rope-jit``, once a process (`CompileWarmup`):
    until ``ready``, and where numba fails, callers rotate with torch."""

    def __init__(self) -> None:
        super().__init__(
            _kernels, _compile, "kvwarden-rope-jit", "blend: compiled RoPE kernels", "rotating with torch"
        )
