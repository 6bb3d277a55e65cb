"""Chunk keys: prefix-chained, scoped to model, rank and KV layout; partial chunks have none."""

from __future__ import annotations

import numpy as np
import pytest

from dataplane.storage.keys import KEY_BYTES, chunk_keys, scope_digest

C = 32
BASE = dict(
    model_name="m",
    world_size=2,
    worker_id=0,
    dtype="bfloat16",
    num_layers=4,
    num_heads=2,
    head_dim=8,
)


def scope(**over: object) -> bytes:
    return scope_digest(**{**BASE, **over})  # type: ignore[arg-type]


def toks(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n, dtype=np.int32)


def test_deterministic_and_sized() -> None:
    t = toks(1, 3 * C)
    a = chunk_keys(scope(), t, C)
    b = chunk_keys(scope(), t.copy(), C)
    assert a == b
    assert len(a) == 3
    assert all(len(k) == KEY_BYTES for k in a)
    assert len(set(a)) == 3


def test_partial_chunk_has_no_key() -> None:
    t = toks(2, 3 * C + C - 1)
    assert len(chunk_keys(scope(), t, C)) == 3
    assert chunk_keys(scope(), t, C) == chunk_keys(scope(), t[: 3 * C], C)
    assert chunk_keys(scope(), t[: C - 1], C) == []
    assert chunk_keys(scope(), t[:0], C) == []


def test_prefix_property() -> None:
    t = toks(3, 5 * C)
    full = chunk_keys(scope(), t, C)
    for n in range(1, 6):
        assert chunk_keys(scope(), t[: n * C], C) == full[:n]


def test_same_chunk_after_different_prefix_differs() -> None:
    shared = toks(4, C)
    a = chunk_keys(scope(), np.concatenate([toks(5, C), shared]), C)
    b = chunk_keys(scope(), np.concatenate([toks(6, C), shared]), C)
    assert a[0] != b[0]
    assert a[1] != b[1]  # same chunk text, different history


def test_same_chunk_at_position_zero_vs_later_differs() -> None:
    c = toks(7, C)
    first = chunk_keys(scope(), c, C)[0]
    second = chunk_keys(scope(), np.concatenate([c, c]), C)[1]
    assert first != second


def test_a_change_in_one_chunk_changes_that_key_and_all_after() -> None:
    t = toks(8, 4 * C)
    u = t.copy()
    u[2 * C + 5] += 1
    a, b = chunk_keys(scope(), t, C), chunk_keys(scope(), u, C)
    assert a[:2] == b[:2]
    assert all(x != y for x, y in zip(a[2:], b[2:], strict=True))


def test_chunk_size_matters() -> None:
    t = toks(9, 4 * C)
    assert chunk_keys(scope(), t, C)[1] != chunk_keys(scope(), t, 2 * C)[0]


@pytest.mark.parametrize(
    "over",
    [
        {"model_name": "other"},
        {"world_size": 4},
        {"worker_id": 1},
        {"dtype": "float16"},
        {"num_layers": 8},
        {"num_heads": 4},
        {"head_dim": 16},
    ],
)
def test_scope_separates(over: dict[str, object]) -> None:
    assert scope(**over) != scope()
    t = toks(10, 2 * C)
    a = chunk_keys(scope(), t, C)
    b = chunk_keys(scope(**over), t, C)
    assert not set(a) & set(b)


def test_token_dtype_does_not_matter() -> None:
    t = toks(11, 2 * C)
    assert chunk_keys(scope(), t.astype(np.int64), C) == chunk_keys(scope(), t, C)
    assert chunk_keys(scope(), t.tolist(), C) == chunk_keys(scope(), t, C)  # type: ignore[arg-type]
