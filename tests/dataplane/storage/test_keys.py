"""Chunk keys: prefix-chained, scoped to model, rank and KV layout; partial chunks have none."""

from __future__ import annotations

import fnmatch

import numpy as np
import pytest

from dataplane.storage.keys import (
    KEY_BYTES,
    ScopeMatch,
    blend_keys,
    chunk_keys,
    filing_scope,
    scope_digest,
    span_marks,
)
from dataplane.wire.context import KeyContext

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


# ------------------------------------------------------------------ key contexts


def test_no_context_and_an_empty_one_key_as_tokens_alone() -> None:
    t = toks(2, 4 * C)
    plain = chunk_keys(scope(), t, C)
    assert chunk_keys(scope(), t, C, None) == plain == chunk_keys(scope(), t, C, KeyContext())


def test_a_salt_or_a_namespace_changes_every_key() -> None:
    t = toks(3, 4 * C)
    plain = chunk_keys(scope(), t, C)
    a = chunk_keys(scope(), t, C, KeyContext(b"tenant-a"))
    b = chunk_keys(scope(), t, C, KeyContext(b"tenant-b"))
    lora = chunk_keys(scope(), t, C, KeyContext(namespace=b"lora:x"))
    both = chunk_keys(scope(), t, C, KeyContext(b"tenant-a", b"lora:x"))
    for keys in (a, b, lora, both):
        assert not set(keys) & set(plain)
    assert not set(a) & set(b) and not set(a) & set(both) and not set(lora) & set(both)
    assert a == chunk_keys(scope(), t.copy(), C, KeyContext(b"tenant-a"))  # the same tenant shares
    # a salt is not a namespace: the two fields cannot stand in for each other
    assert chunk_keys(scope(), t, C, KeyContext(b"x")) != chunk_keys(
        scope(), t, C, KeyContext(namespace=b"x")
    )


def test_a_span_changes_the_chunks_it_overlaps_and_every_later_one_only() -> None:
    t = toks(4, 5 * C)
    plain = chunk_keys(scope(), t, C)
    img = KeyContext(spans=((2 * C + 3, 3 * C + 5, b"image-1"),))
    keyed = chunk_keys(scope(), t, C, img)
    assert keyed[:2] == plain[:2]  # the prefix before the image is shared
    assert not set(keyed[2:]) & set(plain)
    other = chunk_keys(scope(), t, C, KeyContext(spans=((2 * C + 3, 3 * C + 5, b"image-2"),)))
    moved = chunk_keys(scope(), t, C, KeyContext(spans=((2 * C + 4, 3 * C + 5, b"image-1"),)))
    assert other[:2] == plain[:2] and not set(other[2:]) & set(keyed)
    assert moved[:2] == plain[:2] and not set(moved[2:]) & set(keyed)
    # a span past the full chunks keys nothing
    assert chunk_keys(scope(), t, C, KeyContext(spans=((5 * C, 5 * C + 1, b"x"),))) == plain


def test_span_marks_are_relative_to_each_chunk_and_linear() -> None:
    ctx = KeyContext(spans=((-5, 3, b"a"), (3, 100 * C, b"b")))
    marks = span_marks(ctx, 1000, C)
    assert sorted(marks) == list(range(100))  # the long span over 100 chunks, nothing past it
    assert marks[0].count(b"a") == 1 and marks[0].count(b"b") == 1 and b"a" not in marks[1]
    # chunk i of a window from chunk k keys as chunk k + i of the whole sequence
    assert span_marks(ctx.window(3 * C), 1000, C)[0] == marks[3]


def test_blend_keys_of_a_window_are_the_whole_sequences() -> None:
    t = toks(5, 6 * C)
    ctx = KeyContext(b"t", b"n", ((C + 2, 4 * C, b"img"),))
    whole = blend_keys(scope(), t, C, ctx)
    assert blend_keys(scope(), t[2 * C :], C, ctx.window(2 * C)) == whole[2:]
    plain = blend_keys(scope(), t, C)
    assert not set(whole) & set(plain)
    assert blend_keys(scope(), t, C, KeyContext(b"t", b"n")) != whole


def test_a_filing_scope_keeps_its_scopes_head_and_names_salt_and_namespace_by_digest() -> None:
    own, other = scope_digest("m", 1, 0, "bfloat16", 2, 2, 8), scope_digest("m", 1, 1, "bfloat16", 2, 2, 8)
    assert filing_scope(own, None) == own == filing_scope(own, KeyContext(b"", b""))
    a, b = KeyContext(b"tenant-a"), KeyContext(b"tenant-b")
    ax, bx = KeyContext(b"tenant-a", b"ns-x"), KeyContext(b"tenant-b", b"ns-x")
    x = KeyContext(b"", b"ns-x")
    filed = {c: filing_scope(own, c) for c in (a, b, ax, bx, x)}
    assert len(set(filed.values()) | {own}) == 6  # every context its own
    for f in filed.values():
        assert len(f) == 16 and f[:8] == own[:8] and b"tenant" not in f  # no salt written out
    assert filing_scope(other, a) != filed[a]  # a digest keyed by the scope: ranks differ

    def taken(m: ScopeMatch) -> set[bytes]:
        got = {f for f in [own, *filed.values()] if m.matches(f)}
        pattern = m.hex_glob()  # (what Redis's SCAN and the file tier's directories match)
        assert got == {f for f in [own, *filed.values()] if fnmatch.fnmatchcase(f.hex(), pattern)}
        return got

    assert taken(ScopeMatch.whole(own)) == {own, *filed.values()}
    assert taken(ScopeMatch.whole(other)) == set()
    assert taken(ScopeMatch.context(own, b"tenant-a", None)) == {filed[a], filed[ax]}
    assert taken(ScopeMatch.context(own, None, b"ns-x")) == {filed[ax], filed[bx], filed[x]}
    assert taken(ScopeMatch.context(own, b"tenant-b", b"ns-x")) == {filed[bx]}
    assert taken(ScopeMatch.context(own, b"", b"")) == {own}  # no salt, no namespace: the own
    assert taken(ScopeMatch(own)) == {own}
    with pytest.raises(ValueError, match="a context needs a salt or a namespace"):
        ScopeMatch.context(own, None, None)
