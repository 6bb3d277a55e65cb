"""The protocol table (`dataplane.wire.table`): one row per message type, typed replies that
travel as maps and are checked by the client as strictly as requests are by the server, and
docs/protocol.md generated from the declarations."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest

from dataplane.wire import replies as r
from dataplane.wire.errors import ProtocolError
from dataplane.wire.messages import MsgType
from dataplane.wire.protocol import decode_reply, encode_error, encode_ok
from dataplane.wire.records import Reply, field_names, reply_to_wire
from dataplane.wire.table import SPECS, TABLE, HandlerKind, decode_body, decode_error

ROOT = Path(__file__).resolve().parents[3]

# one valid instance of every reply record
SAMPLES: dict[type[Reply], Reply] = {
    r.ServerHello: r.ServerHello("ab12", 7, "0.1.0", 6, 256, 16 << 20),
    r.PingReply: r.PingReply(7, None),
    r.Unregistered: r.Unregistered(True),
    r.Registered: r.Registered(False, 256),
    r.StoreCounts: r.StoreCounts(4, 1, 2, 1, 0),
    r.Retrieved: r.Retrieved(512),
    r.Hits: r.Hits(256, 512),
    r.ScopeHits: r.ScopeHits(512, 256, 0, 256, 256),
    r.Noted: r.Noted(True),
    r.Cleared: r.Cleared(4, 4, 0, 1, ("redis",), False),
    r.PoolRegistered: r.PoolRegistered(True, 256, "kvwarden-1-00", 4096, 4, r.ArenaInfo("a", 8192, 4096)),
    r.PoolRetrieved: r.PoolRetrieved(3),
    r.Reserved: r.Reserved(9, ((0, 0), (2, 4096)), 4096, 1, 0, 0, 3, 8192),
    r.Committed: r.Committed(2),
    r.Acquired: r.Acquired(10, (0, 4096), 4096, 8192),
    r.Released: r.Released(True),
    r.BlendRegistered: r.BlendRegistered(1024),
    r.BlendRetrieved: r.BlendRetrieved(((0, True), (1, False))),
    r.BlendAcquired: r.BlendAcquired(11, ((0, 64), (1, -1)), 4096, 8192),
}


def wire(reply: Reply) -> Any:
    """``reply``'s body as a client receives it."""
    return decode_reply(encode_ok(1, reply)).body


def test_every_message_type_has_one_row_and_every_reply_a_sample() -> None:
    assert [s.type for s in TABLE] == list(MsgType)
    assert {s.reply for s in TABLE} == set(SAMPLES)
    # only transfers are answered inline; every inline row is a transfer
    assert {s.type for s in TABLE if s.inline} == {MsgType.ENGINE_RESERVE, MsgType.ENGINE_ACQUIRE}
    assert all(s.kind is HandlerKind.TRANSFER for s in TABLE if s.inline)


@pytest.mark.parametrize("spec", TABLE, ids=lambda s: s.type.value)
def test_every_reply_travels_as_the_map_of_its_fields_and_comes_back_equal(spec: Any) -> None:
    sample = SAMPLES[spec.reply]
    body = wire(sample)
    assert isinstance(body, dict) and list(body) == list(field_names(spec.reply))
    assert decode_body(spec.type, body) == sample


def test_a_nil_arena_travels_as_nil() -> None:
    pool = r.PoolRegistered(False, 256, "kvwarden-1-00", 4096, 4, None)
    body = wire(pool)
    assert body["arena"] is None and decode_body(MsgType.ENGINE_REGISTER, body) == pool


@pytest.mark.parametrize(
    ("mtype", "body", "names"),
    [
        (MsgType.LOOKUP, [256], "a reply must be a map"),
        (MsgType.LOOKUP, {}, "fields missing ['hit_tokens', 'pending_tokens']"),
        (MsgType.LOOKUP, {"hit_tokens": 1, "pending_tokens": 0, "extra": 2}, "unknown [\"'extra'\"]"),
        (
            MsgType.LOOKUP,
            {"hit_tokens": "256", "pending_tokens": 0},
            "LOOKUP reply.hit_tokens: expected an integer",
        ),
        (
            MsgType.LOOKUP,
            {"hit_tokens": 0, "pending_tokens": -1},
            "LOOKUP reply.pending_tokens: -1 is out of range",
        ),
        (MsgType.PING, {"boot_token": 1, "tracked": 1}, "PING reply.tracked: expected a boolean"),
        (
            MsgType.ENGINE_ACQUIRE,
            {"lease": 1, "offsets": [0] * 65, "slot_bytes": 1, "usable": 1},
            "ENGINE_ACQUIRE reply.offsets: 65 items exceeds the limit of 64",
        ),
        (
            MsgType.ENGINE_RESERVE,
            {**wire(SAMPLES[r.Reserved]), "slots": [[0]]},
            "ENGINE_RESERVE reply.slots[0]: expected a two-item array",
        ),
        (
            MsgType.ENGINE_REGISTER,
            {**wire(SAMPLES[r.PoolRegistered]), "arena": {"segment": "a", "bytes": 1}},
            "ENGINE_REGISTER reply.arena: fields missing ['usable']",
        ),
    ],
    ids=["not-a-map", "missing", "unknown", "type", "range", "bool", "too-many", "pair", "nested"],
)
def test_a_reply_that_does_not_check_is_refused_naming_the_field(
    mtype: MsgType, body: Any, names: str
) -> None:
    with pytest.raises(ProtocolError) as exc:
        decode_body(mtype, body)
    assert names in str(exc.value)


def test_an_error_reply_is_a_typed_record_and_a_malformed_one_says_so() -> None:
    class Boom(ProtocolError):
        code = "BAD_REQUEST"

    body = decode_reply(encode_error(3, Boom("x" * 100_000))).body
    err = decode_error(body)
    assert (err.code, len(err.message)) == ("BAD_REQUEST", r.MAX_ERROR_CHARS)  # cut, not refused
    bad = decode_error({"code": 7})
    assert bad.code == "INTERNAL" and "malformed error reply" in bad.message


def test_only_reply_records_are_encoded_in_a_reply() -> None:
    with pytest.raises(TypeError, match="cannot encode object in a reply"):
        msgpack.packb([1, object()], default=reply_to_wire)
    assert SPECS[MsgType.STORE].reply is r.StoreCounts


def test_protocol_doc_agrees_with_the_table() -> None:
    """`make lint` runs the same check; here it guards the suite too."""
    out = subprocess.run(
        [sys.executable, "scripts/gen_protocol_doc.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]


def test_protocol_doc_check_fails_when_the_document_disagrees(tmp_path: Path) -> None:
    doc = (ROOT / "docs" / "protocol.md").read_text()
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_protocol_doc as gen
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    edited = doc.replace("| `hit_tokens` |", "| `hits` |", 1)
    assert edited != doc
    assert gen.spliced(edited, gen.render()) == doc  # regenerating restores it
    assert "hit_tokens" in gen.render() and "StoreCounts" in gen.render()
