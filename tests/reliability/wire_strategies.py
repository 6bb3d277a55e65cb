"""What the wire fuzz (`tests.reliability.test_wire_fuzz`) sends: frame values, Hypothesis
strategies, and the frames of the sweep.

First a sweep: each field of each message type (and of the request frame, and of a REGISTER's
layer) replaced in turn by every edge value: -1, 2^63, 2^64 - 1 (msgpack has no 2^64: that one
travels as a float), NaN, infinities, huge strings, empty and oversized ``bin`` ids and secrets,
values nested near msgpack's depth limit, hand-made msgpack declaring huge lengths. Then
Hypothesis-generated batches: random bytes; valid msgpack of every shape; frames of every message
type, valid or with a field replaced by a hostile value, a field too many or too few, or no array
at all; valid transfers of two instances registered over real shared memory before every batch.
Any of them may travel with routing frames before it (a multipart message).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import msgpack
import numpy as np
import torch
from hypothesis import strategies as st

from dataplane.client.kvalloc import describe_caches
from dataplane.memory.kvmemory import contiguous_strides
from dataplane.wire.checks import ids_to_bytes
from dataplane.wire.messages import (
    KV_CODECS,
    SUPPORTED_DTYPES,
    BlendAcquire,
    BlendRegister,
    BlendReserve,
    BlendRetrieve,
    BlendStore,
    ClearScope,
    CudaLayer,
    EngineAcquire,
    EngineCommit,
    EngineRelease,
    EngineReserve,
    EngineRetrieve,
    EngineStore,
    GetServerInfo,
    Hello,
    KVFormat,
    Lookup,
    LookupScope,
    LookupWaited,
    Message,
    MsgType,
    Ping,
    PrefetchScope,
    Register,
    Retrieve,
    ShmLayer,
    Store,
    Unregister,
    encode_payload,
    field_names,
)
from dataplane.wire.protocol import PROTOCOL_VERSION
from dataplane.wire.table import BY_TYPE, MESSAGES
from tests.dataplane.registration import SECRET, engine_register_message, register_message

MAX_FRAME = 65536  # the server's --max-frame-bytes: FRAME_TOO_LARGE is cheap to reach
HARD_CAP = max(4 * MAX_FRAME, MAX_FRAME + (1 << 20))  # beyond it libzmq drops the peer: stay below
CHUNK = 16
NUM_BLOCKS, BLOCK = 8, 16
LAYOUT = dict(
    num_layers=2, num_blocks=NUM_BLOCKS, block_size=BLOCK, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16
)
REG_ID = 0x5EED_0001  # a server-driven instance of the real caches, re-registered every batch
ENG_ID = 0x5EED_0002  # an engine-driven instance, re-registered every batch

# ------------------------------------------------------------------------------ frame values


@dataclasses.dataclass(frozen=True)
class Raw:
    """Hand-made msgpack spliced into a frame as it is."""

    data: bytes

    def __repr__(self) -> str:
        return f"Raw({self.data[:24]!r}{'...' if len(self.data) > 24 else ''} {len(self.data)} B)"


class _Auto:
    """Where a frame's request id goes: the sender puts a fresh one there."""

    def __repr__(self) -> str:
        return "AUTO"


AUTO = _Auto()
_HEADERS = msgpack.Packer()


def encode(v: Any, rid: int) -> bytes:
    """msgpack of ``v``, with `Raw` spliced in and `AUTO` replaced by ``rid`` (no nesting limit
    of msgpack's packer applies to `Raw`)."""
    if v is AUTO:
        return msgpack.packb(rid)
    if isinstance(v, Raw):
        return v.data
    if isinstance(v, list):
        return _HEADERS.pack_array_header(len(v)) + b"".join(encode(x, rid) for x in v)
    if isinstance(v, dict):
        items = b"".join(encode(k, rid) + encode(x, rid) for k, x in v.items())
        return _HEADERS.pack_map_header(len(v)) + items
    data: bytes = msgpack.packb(v, use_bin_type=True)
    return data


def nested(depth: int) -> Raw:
    """``depth`` arrays of one element around a nil, in 2 bytes a level (no packer limit)."""
    return Raw(b"\x91" * depth + b"\xc0")


U64 = 1 << 64
EDGE_INTS = [-1, 0, 1, 255, 256, 65536, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, U64 - 1]
EDGE_INTS += [-(2**31), -(2**63)]  # msgpack carries [-2^63, 2^64): 2^64 itself only as a float
EDGE_FLOATS = [math.nan, math.inf, -math.inf, -0.0, 0.5, 1e308, float(2**63), float(U64)]
BIG_VALUES: list[Any] = [
    "",
    "n" * 256,
    "n" * 257,
    "é" * 20_000,  # a 40,000-byte string
    "x" * 60_000,
    b"",
    b"\x00" * 1024,
    b"\x00" * 60_000,
    b"\x00" * 70_000,  # the frame is over the limit: FRAME_TOO_LARGE
    b"\x00" * 300_000,  # over, but under the hard cap, so it is read and answered
]
HAND_MADE = [
    # around msgpack's nesting limit (1024 levels, the frame's own two included)
    *(nested(d) for d in (64, 500, 1000, 1010, 1016, 1020, 1021, 1022, 1023, 1024, 1100, 4000)),
    Raw(b"\xdd\xff\xff\xff\xff"),  # array32 of 2^32 - 1 items, none following
    Raw(b"\xdf\xff\xff\xff\xff"),  # map32
    Raw(b"\xc6\xff\xff\xff\xff\x00\x00"),  # bin32 of 4 GiB, 2 bytes following
    Raw(b"\xdb\xff\xff\xff\xffab"),  # str32
    Raw(b"\xc9\xff\xff\xff\xff\x05"),  # ext32
    Raw(b"\xdc\xff\xff\xc0"),  # array16 of 65535 items, one following
    Raw(b"\xc6\x00\x01\x00\x00ab"),  # bin32 of 65536 bytes, 2 following
    Raw(b"\xa3\xff\xfe\xfd"),  # a str that is not UTF-8
    Raw(b"\xc1"),  # the never-used byte
    Raw(b"\xd4\xff\x00"),  # a timestamp ext of a length msgpack refuses
    Raw(b"\xd6\xff\x00\x00\x00\x01"),  # a valid timestamp
    Raw(b"\xd4\x05\x00"),  # fixext 1 of an application type
    Raw(msgpack.packb({1: "a"})),  # keys that are not strings (the server is strict)
    Raw(msgpack.packb({b"k": 1}, use_bin_type=True)),
    Raw(msgpack.packb({None: [1]})),
    Raw(b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x01"),  # a NaN with a payload
    Raw(b"\xca\x7f\x80\x00\x00"),  # float32 infinity
    Raw(b"\x92\x01"),  # an array short of its items: the frame ends inside it
]
TYPE_NAMES = [*(t.value for t in MsgType), "ping", "PING ", "", "X" * 300, "REGISTER"]

ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers(-(2**63), U64 - 1))
floats = st.one_of(st.sampled_from(EDGE_FLOATS), st.floats())
scalars = st.one_of(
    st.none(),
    st.booleans(),
    ints,
    floats,
    st.text(max_size=20),
    st.binary(max_size=40),
    st.sampled_from(BIG_VALUES),
    st.sampled_from(TYPE_NAMES),
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8)),
)
values = st.recursive(
    scalars,
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=10,
)
hostile = st.one_of(values, st.sampled_from(HAND_MADE))
NEAR_NESTING_LIMIT = st.integers(960, 1040)  # levels of arrays around a value

# ------------------------------------------------------------------ payloads, field by field


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The real caches the fuzzed registrations point at."""

    register: Register  # a valid REGISTER of them (REG_ID)
    segment: str
    segment_bytes: int
    layer_bytes: int


def geometry(caches: list[torch.Tensor]) -> Geometry:
    reg = register_message(REG_ID, caches, model="fuzz")
    layer_bytes = caches[0].numel() * caches[0].element_size()
    segment = describe_caches(caches).segments[0]
    return Geometry(reg, segment, layer_bytes * len(caches), layer_bytes)


def _arange(n: int) -> bytes:
    return np.arange(n, dtype="<i4").tobytes()


def _ids_bytes() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.integers(0, 300).map(_arange),
        st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40).map(ids_to_bytes),
        st.binary(max_size=9),  # lengths that are not a multiple of 4, and empty
        st.sampled_from([b"\x00" * (4 * 15_000), b"\x00" * (4 * 20_000), b"\xff" * 4]),
    )


SECRETS = st.one_of(
    st.just(SECRET),
    st.just(SECRET),
    st.binary(min_size=16, max_size=64),
    st.sampled_from([b"", b"\x00" * 15, b"\x00" * 65, b"\x00" * 70_000, "a" * 16]),
)
_SET_UP = st.sampled_from([REG_ID, ENG_ID])
INSTANCE_IDS = st.one_of(_SET_UP, _SET_UP, st.integers(0, 2**63 - 1))
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "instance_id": INSTANCE_IDS,
    "secret": SECRETS,
    "lease": st.one_of(st.integers(0, 40), st.integers(0, 2**63 - 1)),
    "model_name": st.one_of(st.just("fuzz"), st.text(min_size=1, max_size=12)),
    "world_size": st.integers(1, 4),
    "worker_id": st.integers(0, 3),
    "dtype": st.sampled_from(SUPPORTED_DTYPES),
    "owner_pid": st.integers(0, 2**31),
    # tokens whose full chunks fit the real caches' blocks, in half the requests
    "token_ids": st.one_of(st.integers(0, NUM_BLOCKS * BLOCK).map(_arange), _ids_bytes()),
    "block_ids": st.one_of(
        st.permutations(range(NUM_BLOCKS)).map(ids_to_bytes),
        st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=24).map(ids_to_bytes),
        st.lists(st.integers(-2, 10), max_size=24).map(ids_to_bytes),
        _ids_bytes(),
    ),
    "num_layers": st.integers(1, 4),
    "heads": st.integers(1, 8),
    "head_dim": st.integers(1, 16),
    "pool_chunks": st.integers(1, 8),
    "first_chunk": st.one_of(st.integers(0, 4), st.integers(0, 24)),
    "n_chunks": st.one_of(st.integers(0, 4), st.integers(0, 9)),
    "kv_format": st.sampled_from([f.value for f in KVFormat]),
    "rotary_dim": st.one_of(st.sampled_from([2, 8, 16]), st.integers(0, 1 << 16)),
    "base": st.one_of(st.just(10000.0), st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 10)),
    "style": st.sampled_from(["neox", "interleaved", "x"]),
    "scaling": st.one_of(st.just(1.0), st.floats(allow_nan=True, allow_infinity=True)),
    "max_positions": st.one_of(st.integers(1, 4096), st.integers(0, 2**63 - 1)),
    "position": st.one_of(st.integers(0, 64), st.integers(0, 1 << 31)),
    "block_size": st.one_of(st.sampled_from([1, BLOCK, 2 * BLOCK]), st.integers(1, 1 << 16)),
    "count": st.one_of(st.none(), st.integers(-1, 70)),  # ENGINE_COMMIT: part of a lease, or all
    "waited_s": st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5000)),
    "outcome": st.sampled_from(["hit", "partial", "gave_up", "", "later"]),
    # LOOKUP_SCOPE's window in chunks: none, a few, past the prompt, or out of range
    "window": st.one_of(st.integers(0, 5), st.integers(-3, 1 << 17)),
    # how an engine's chunks are stored: a codec, or a name none is
    "kv_codec": st.one_of(st.sampled_from(KV_CODECS), st.text(max_size=8)),
    # a key context: none, a valid one (salt, namespace, spans), or fields of the wrong shape
    "key": st.one_of(
        st.none(),
        st.tuples(
            st.binary(max_size=300),
            st.binary(max_size=300),
            st.lists(
                st.tuples(
                    st.integers(-64, 4 * BLOCK), st.integers(-64, 4 * BLOCK), st.binary(max_size=80)
                ).map(list),
                max_size=6,
            ),
        ).map(list),
        st.one_of(st.binary(max_size=8), st.integers(-(2**63), 2**63 - 1), st.lists(st.none(), max_size=4)),
    ),
    # the engine's names of the blocks (KV events): none, a plausible one, or of the wrong shape
    # (every int one msgpack can carry)
    "blocks": st.one_of(
        st.none(),
        st.tuples(
            st.sampled_from([1, BLOCK, 3, 1 << 17]),
            st.lists(st.one_of(st.integers(-1, 2**64 - 1), st.binary(max_size=70)), max_size=80),
            st.one_of(st.none(), st.text(max_size=300)),
            st.one_of(
                st.none(),
                st.lists(
                    st.one_of(
                        st.none(),
                        st.lists(
                            st.one_of(st.text(max_size=8), st.integers(-(2**63), 2**64 - 1)), max_size=4
                        ),
                    )
                ),
            ),
        ).map(list),
        st.one_of(st.binary(max_size=8), st.integers(-(2**63), 2**64 - 1), st.lists(st.none(), max_size=4)),
    ),
}


@st.composite
def _register_payload(draw: st.DrawFn, geo: Geometry) -> list[Any]:
    """A REGISTER close to the real one: another id, secret, geometry, segment, offsets or
    strides, or CUDA layers on a server without CUDA."""
    reg = dataclasses.replace(geo.register, instance_id=draw(INSTANCE_IDS), secret=draw(SECRETS))
    payload = encode_payload(reg)
    names = field_names(Register)
    shape = list(reg.kv_shape)
    if draw(st.booleans()):
        shape = [2, *draw(st.lists(st.integers(1, 64), min_size=4, max_size=4))]
        payload[names.index("kv_shape")] = shape
    contiguous = list(contiguous_strides(tuple(shape)))
    n_layers = draw(st.integers(1, 3))
    if draw(st.integers(0, 4)) == 0:
        payload[names.index("memory")] = "cuda_ipc"
        cuda = st.builds(
            CudaLayer,
            st.text(min_size=1, max_size=8),
            st.integers(0, 1024),
            st.binary(max_size=64),
            st.integers(0, 2**40),
            st.integers(0, 2**20),
            st.integers(0, 2**20),
            st.binary(max_size=16),
            st.integers(0, 64),
            st.binary(max_size=16),
            st.booleans(),
            st.just(tuple(contiguous)),
        )
        payload[names.index("layers")] = [encode_payload(draw(cuda)) for _ in range(n_layers)]
        return payload
    segments = [geo.segment, geo.segment, "kvwarden-1-0123456789abcdef", "kvwarden-x", "../../etc/passwd"]
    layers = []
    for i in range(n_layers):
        offset = draw(
            st.one_of(
                st.just(i * geo.layer_bytes),
                st.integers(0, 2 * geo.segment_bytes),
                st.sampled_from([1, geo.segment_bytes, 2**62, 2**63 - 1]),
            )
        )
        strides = draw(
            st.one_of(st.just(contiguous), st.lists(st.integers(0, 2**63 - 1), min_size=5, max_size=5))
        )
        layers.append(encode_payload(ShmLayer(draw(st.sampled_from(segments)), offset, tuple(strides))))
    payload[names.index("layers")] = layers
    return payload


def _payload(mtype: MsgType, geo: Geometry) -> st.SearchStrategy[list[Any]]:
    """A payload of ``mtype`` whose fields are each of the right type (mostly valid)."""
    if mtype is MsgType.PING:
        return st.one_of(st.just([None, None]), st.tuples(INSTANCE_IDS, SECRETS).map(list))
    if mtype is MsgType.REGISTER_KV_CACHE:
        return _register_payload(geo)
    names = field_names(BY_TYPE[mtype])
    fields = {**FIELDS, "instance_id": _OWN_ID.get(mtype, INSTANCE_IDS)}
    return st.tuples(*(fields[n] for n in names)).map(list)


# transfers mostly name the set-up instance of their mode; UNREGISTER mostly another one
_OWN_ID = {
    MsgType.STORE: st.one_of(st.just(REG_ID), INSTANCE_IDS),
    MsgType.RETRIEVE: st.one_of(st.just(REG_ID), INSTANCE_IDS),
    MsgType.ENGINE_STORE: st.one_of(st.just(ENG_ID), INSTANCE_IDS),
    MsgType.ENGINE_RETRIEVE: st.one_of(st.just(ENG_ID), INSTANCE_IDS),
    MsgType.ENGINE_RESERVE: st.one_of(st.just(ENG_ID), INSTANCE_IDS),
    MsgType.ENGINE_COMMIT: st.one_of(st.just(ENG_ID), INSTANCE_IDS),
    MsgType.ENGINE_ACQUIRE: st.one_of(st.just(ENG_ID), INSTANCE_IDS),
    MsgType.ENGINE_RELEASE: st.one_of(st.just(ENG_ID), INSTANCE_IDS),
    MsgType.BLEND_REGISTER: st.one_of(st.just(REG_ID), INSTANCE_IDS),
    MsgType.BLEND_STORE: st.one_of(st.just(REG_ID), INSTANCE_IDS),
    MsgType.BLEND_RETRIEVE: st.one_of(st.just(REG_ID), INSTANCE_IDS),
    MsgType.BLEND_RESERVE: st.one_of(st.just(ENG_ID), INSTANCE_IDS),
    MsgType.BLEND_ACQUIRE: st.one_of(st.just(ENG_ID), INSTANCE_IDS),
    MsgType.UNREGISTER_KV_CACHE: st.one_of(st.integers(0, 2**63 - 1), INSTANCE_IDS),
}


@st.composite
def _mutated(draw: st.DrawFn, payload: list[Any]) -> Any:
    how = draw(st.sampled_from(["keep", "keep", "keep", "field", "field", "deep", "drop", "extra", "shape"]))
    if how == "field" and payload:
        payload[draw(st.integers(0, len(payload) - 1))] = draw(hostile)
    elif how == "deep" and payload:  # a field's value inside arrays, near msgpack's nesting limit
        i = draw(st.integers(0, len(payload) - 1))
        payload[i] = Raw(b"\x91" * draw(NEAR_NESTING_LIMIT) + encode(payload[i], 0))
    elif how == "drop" and payload:
        del payload[draw(st.integers(0, len(payload) - 1))]
    elif how == "extra":
        payload.append(draw(hostile))
    elif how == "shape":
        return draw(hostile)
    return payload


# -------------------------------------------------------------------------------- the shots


@dataclasses.dataclass(frozen=True)
class Shot:
    """One message: ``body`` (bytes as they are, or a value for `encode`) after ``envelope``."""

    kind: str
    body: Any
    envelope: tuple[bytes, ...] = ()

    def frame(self, rid: int) -> bytes:
        return self.body if isinstance(self.body, bytes) else encode(self.body, rid)

    def __repr__(self) -> str:  # bodies reach 300 kB: Hypothesis prints this one, not the fields
        return f"Shot({self.kind!r}, {repr(self.body)[:300]}, envelope={self.envelope!r})"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(repr(self))


@st.composite
def _message(draw: st.DrawFn, geo: Geometry) -> Shot:
    mtype = draw(st.sampled_from(list(MsgType)))
    payload = draw(_payload(mtype, geo))
    if draw(st.booleans()):  # half the frames as they are: mostly valid requests
        return Shot(f"message:{mtype.value}", [PROTOCOL_VERSION, AUTO, mtype.value, payload])
    payload = draw(_mutated(payload))
    version: Any = PROTOCOL_VERSION if draw(st.integers(0, 9)) else draw(st.one_of(ints, hostile))
    rid: Any = AUTO if draw(st.integers(0, 9)) else draw(st.one_of(ints, hostile))
    type_field: Any = (
        mtype.value if draw(st.integers(0, 14)) else draw(st.one_of(st.sampled_from(TYPE_NAMES), hostile))
    )
    frame: list[Any] = [version, rid, type_field, payload]
    shape = draw(st.integers(0, 19))
    if shape == 0:
        frame.append(draw(hostile))
    elif shape == 1:
        del frame[draw(st.integers(0, 3))]
    return Shot(f"message:{mtype.value}", frame)


@st.composite
def _transfer(draw: st.DrawFn) -> Shot:
    """A valid transfer or LOOKUP of a set-up instance: random tokens after a shared prefix (so
    that some chunks are already held), blocks that hold them."""
    prefix = draw(st.integers(0, NUM_BLOCKS * BLOCK))
    rest = draw(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=NUM_BLOCKS * BLOCK - prefix))
    tokens = np.asarray([*range(prefix), *rest], dtype="<i4")
    blocks = np.asarray(draw(st.permutations(range(NUM_BLOCKS))), dtype="<i4")
    full = len(tokens) // CHUNK
    first = draw(st.integers(0, full))
    n = draw(st.integers(0, min(full - first, 4)))  # the engine pool of the set-up has 4 slots
    msg = draw(
        st.sampled_from(
            [
                Store(REG_ID, SECRET, tokens, blocks),
                Retrieve(REG_ID, SECRET, tokens, blocks),
                Lookup(REG_ID, SECRET, tokens),
                Lookup(ENG_ID, SECRET, tokens),
                EngineStore(ENG_ID, SECRET, tokens, first, n),
                EngineRetrieve(ENG_ID, SECRET, tokens, first, n),
            ]
        )
    )
    return Shot(f"transfer:{msg.TYPE.value}", [PROTOCOL_VERSION, AUTO, msg.TYPE.value, encode_payload(msg)])


def shots(geo: Geometry) -> st.SearchStrategy[Shot]:
    bodies = st.one_of(
        _transfer(),
        st.binary(max_size=200).map(lambda b: Shot("bytes", b)),
        st.sampled_from([b"", b"\x00" * MAX_FRAME, b"\x00" * (MAX_FRAME + 1), b"\x94" * 8]).map(
            lambda b: Shot("bytes", b)
        ),
        hostile.map(lambda v: Shot("value", v)),
        _message(geo),
        _message(geo),
        _message(geo),
    )
    envelope = st.one_of(
        st.just(()),
        st.just(()),
        st.just(()),
        st.lists(st.binary(max_size=24), min_size=1, max_size=3).map(tuple),
    )
    shot = st.builds(lambda s, e: dataclasses.replace(s, envelope=e), bodies, envelope)
    # a few big values together could pass the hard cap, where libzmq drops the connection
    return shot.filter(lambda s: len(s.frame(0)) + 16 < HARD_CAP)


# -------------------------------------------------------------------------------- the sweep


def setup_shots(geo: Geometry) -> list[Shot]:
    """Valid REGISTERs of both instances (a refresh when they are still there), so that fuzzed
    transfers with the right id and secret reach the copy paths."""
    eng = dataclasses.replace(engine_register_message(ENG_ID), model_name="fuzz")
    return [
        Shot(
            "setup:register", [PROTOCOL_VERSION, AUTO, geo.register.TYPE.value, encode_payload(geo.register)]
        ),
        Shot("setup:engine_register", [PROTOCOL_VERSION, AUTO, eng.TYPE.value, encode_payload(eng)]),
    ]


def _valid_messages(geo: Geometry) -> list[Message]:
    """One valid request of every message type, about the two set-up instances."""
    tokens, blocks = np.arange(2 * CHUNK, dtype="<i4"), np.arange(2, dtype="<i4")
    msgs: list[Message] = [
        Hello(),
        GetServerInfo(),
        Ping(REG_ID, SECRET),
        geo.register,
        Lookup(REG_ID, SECRET, tokens),
        LookupScope("fuzz", 1, "bfloat16", 2, 2, 8, KVFormat.TOKEN_MAJOR, BLOCK, tokens),
        LookupWaited(0.01, "hit"),
        PrefetchScope("fuzz", 1, "bfloat16", 2, 2, 8, KVFormat.TOKEN_MAJOR, BLOCK, tokens),
        ClearScope("fuzz-other", 1, "bfloat16", 2, 2, 8, KVFormat.TOKEN_MAJOR, BLOCK),  # (not fuzz's)
        Store(REG_ID, SECRET, tokens, blocks),
        Retrieve(REG_ID, SECRET, tokens, blocks),
        dataclasses.replace(engine_register_message(ENG_ID), model_name="fuzz"),
        EngineStore(ENG_ID, SECRET, tokens, 0, 2),
        EngineRetrieve(ENG_ID, SECRET, tokens, 0, 2),
        EngineReserve(ENG_ID, SECRET, tokens, 0, 2),
        EngineCommit(ENG_ID, SECRET, 1),
        EngineAcquire(ENG_ID, SECRET, tokens, 0, 2),
        EngineRelease(ENG_ID, SECRET, 2),
        BlendRegister(REG_ID, SECRET, 8, 10000.0, "neox", 1.0, 4096),
        BlendStore(REG_ID, SECRET, tokens, blocks, 0),
        BlendRetrieve(REG_ID, SECRET, tokens, blocks, 16),
        BlendReserve(ENG_ID, SECRET, tokens),
        BlendAcquire(ENG_ID, SECRET, tokens),
        Unregister(REG_ID, SECRET),
    ]
    assert {type(m) for m in msgs} == set(MESSAGES)
    return msgs


def _sweep_values(valid: Any) -> list[Any]:
    """Every edge value, and ``valid`` itself inside arrays near msgpack's nesting limit."""
    deep = [Raw(b"\x91" * d + encode(valid, 0)) for d in (1000, 1016, 1021, 1022)]
    return [*EDGE_INTS, *EDGE_FLOATS, *BIG_VALUES, *HAND_MADE, None, True, [], {}, "x", *deep]


def sweep_shots(geo: Geometry) -> list[Shot]:
    """Each field of each message type, and each field of the request frame and of a REGISTER's
    layer, replaced in turn by every edge value of `_sweep_values`; and each payload replaced."""
    out: list[Shot] = []
    frame = [PROTOCOL_VERSION, AUTO, MsgType.PING.value, [None, None]]
    for i, what in enumerate(("version", "request_id", "type")):
        for v in _sweep_values(frame[i]):
            out.append(Shot(f"sweep:frame.{what}", [*frame[:i], v, *frame[i + 1 :]]))
    for msg in _valid_messages(geo):
        base = encode_payload(msg)
        head = [PROTOCOL_VERSION, AUTO, msg.TYPE.value]
        out += [Shot(f"sweep:{msg.TYPE.value}", [*head, v]) for v in _sweep_values(base)]
        for i, name in enumerate(field_names(type(msg))):
            for v in _sweep_values(base[i]):
                out.append(Shot(f"sweep:{msg.TYPE.value}.{name}", [*head, [*base[:i], v, *base[i + 1 :]]]))
    reg, reg_type = encode_payload(geo.register), MsgType.REGISTER_KV_CACHE.value
    at = field_names(Register).index("layers")
    for j, name in enumerate(field_names(ShmLayer)):
        layer = reg[at][0]
        for v in _sweep_values(layer[j]):
            layers = [[*layer[:j], v, *layer[j + 1 :]], *reg[at][1:]]
            payload = [*reg[:at], layers, *reg[at + 1 :]]
            out.append(
                Shot(f"sweep:{reg_type}.layers[0].{name}", [PROTOCOL_VERSION, AUTO, reg_type, payload])
            )
    return out
