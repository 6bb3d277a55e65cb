"""`dataplane.wire.messages`: the request records, decoded from their positional payloads,
every field checked and named when refused, and the secret every message about an instance carries."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane.wire import checks as c
from dataplane.wire import messages as m
from dataplane.wire.errors import ProtocolError
from tests.dataplane.registration import SECRET
from tests.dataplane.wire.payloads import (
    IID,
    INSTANCE_MESSAGES,
    NO_IDS,
    cuda_layer,
    decode,
    payload_of,
    shm_register,
)


@dataclasses.dataclass(frozen=True, slots=True)
class _AB(m.Record):
    a: Annotated[int, c.u63]
    b: Annotated[str, c.name]


def test_fields() -> None:
    assert m.field_names(_AB) == ("a", "b")
    assert m.decode_record(_AB, [1, "x"], "MSG") == _AB(1, "x")
    assert m.encode_payload(_AB(1, "x")) == [1, "x"]
    with pytest.raises(ProtocolError, match="MSG: payload must be an array, got dict"):
        m.decode_record(_AB, {"a": 1}, "MSG")
    with pytest.raises(ProtocolError, match=r"MSG: expected 2 payload fields \(a, b\), got 3"):
        m.decode_record(_AB, [1, "x", 3], "MSG")
    with pytest.raises(ProtocolError, match=r"MSG: expected 0 payload fields \(nothing\), got 1"):
        m.decode_record(m.Hello, [1], "MSG")
    with pytest.raises(ProtocolError, match=r"MSG\.b: expected a string"):
        m.decode_record(_AB, [1, 2], "MSG")


# ----------------------------------------------------------------------- payload parsers


PING = m.Ping(IID, SECRET)
UNREG = m.Unregister(IID, SECRET)
STORE = m.Store(IID, SECRET, NO_IDS, NO_IDS)
RETRIEVE = m.Retrieve(IID, SECRET, NO_IDS, NO_IDS)
LOOKUP = m.Lookup(IID, SECRET, NO_IDS)
S = SECRET


@pytest.mark.parametrize(
    ("mtype", "payload", "message"),
    [
        ("HELLO", [1], r"HELLO: expected 0 payload fields \(nothing\), got 1"),
        ("HELLO", None, "HELLO: payload must be an array, got NoneType"),
        ("GET_SERVER_INFO", [None], "GET_SERVER_INFO: expected 0 payload fields"),
        ("PING", [], r"PING: expected 2 payload fields \(instance_id, secret\), got 0"),
        ("PING", [1, S, 2], r"PING: expected 2 payload fields \(instance_id, secret\), got 3"),
        ("PING", payload_of(PING, instance_id="x"), "PING.instance_id: expected an integer, got str"),
        ("PING", payload_of(PING, instance_id=1.5), "PING.instance_id: expected an integer, got float"),
        ("PING", payload_of(PING, instance_id=-1), r"PING.instance_id: -1 is out of range \[0, 2\^63\)"),
        (
            "PING",
            payload_of(PING, instance_id=1 << 63),
            r"PING.instance_id: 9223372036854775808 is out of range",
        ),
        (
            "UNREGISTER_KV_CACHE",
            payload_of(UNREG, instance_id=None),
            "UNREGISTER_KV_CACHE.instance_id: expected an integer",
        ),
        ("UNREGISTER_KV_CACHE", [], r"UNREGISTER_KV_CACHE: expected 2 payload fields"),
        (
            "STORE",
            [IID, S, b""],
            r"STORE: expected 6 payload fields \(instance_id, secret, token_ids, "
            r"block_ids, key, blocks\), got 3",
        ),
        ("STORE", payload_of(STORE, token_ids=[1, 2]), "STORE.token_ids: expected bytes"),
        ("STORE", payload_of(STORE, key=b"salt"), "STORE.key: payload must be an array, got bytes"),
        ("STORE", payload_of(STORE, key=[b"s", b""]), r"STORE.key: expected 3 payload fields"),
        ("LOOKUP", payload_of(LOOKUP, key=["s", b"", []]), "LOOKUP.key.salt: expected bytes, got str"),
        ("LOOKUP", payload_of(LOOKUP, key=[b"s" * 257, b"", []]), "LOOKUP.key.salt: 257 bytes exceeds"),
        ("LOOKUP", payload_of(LOOKUP, key=[b"", b"n" * 257, []]), "LOOKUP.key.namespace: 257 bytes"),
        ("RETRIEVE", payload_of(RETRIEVE, key=[b"", b"", [[0, 4]]]), r"RETRIEVE.key.spans\[0\]: expected"),
        ("RETRIEVE", payload_of(RETRIEVE, key=[b"", b"", [[4, 4, b"d"]]]), r"\[4, 4\) is not a range"),
        ("RETRIEVE", payload_of(RETRIEVE, key=[b"", b"", [[0, 1.5, b"d"]]]), "must be integers"),
        ("RETRIEVE", payload_of(RETRIEVE, key=[b"", b"", [[0, 8, b""]]]), "digest must be 1 to 64 bytes"),
        ("RETRIEVE", payload_of(RETRIEVE, key=[b"", b"", [[0, 8, b"d" * 65]]]), "digest must be 1 to 64"),
        (
            "STORE",
            payload_of(STORE, key=[b"", b"", [[0, 8, b"a"], [4, 12, b"b"]]]),
            r"STORE.key.spans\[1\]: starts at 4, inside or before the span before it \(ends 8\)",
        ),
        (
            "STORE",
            payload_of(STORE, key=[b"", b"", [[0, 1, b"a"]] * 65537]),
            "STORE.key.spans: 65537 spans exceeds the limit of 65536",
        ),
        ("STORE", payload_of(STORE, blocks=[16, [1, 2]]), r"STORE.blocks: expected 4 payload fields"),
        (
            "STORE",
            payload_of(STORE, blocks=[0, [1], None, None]),
            r"STORE.blocks.block_size: 0 is out of range",
        ),
        (
            "STORE",
            payload_of(STORE, blocks=[16, [1, -1], None, None]),
            r"STORE.blocks.hashes\[1\]: -1 is not a u64",
        ),
        (
            "STORE",
            payload_of(STORE, blocks=[16, [1 << 64], None, None]),
            r"STORE.blocks.hashes\[0\]: .* is not a u64",
        ),
        (
            "STORE",
            payload_of(STORE, blocks=[16, [1.5], None, None]),
            r"STORE.blocks.hashes\[0\]: expected a u64 int",
        ),
        (
            "STORE",
            payload_of(STORE, blocks=[16, [b"h" * 65], None, None]),
            r"STORE.blocks.hashes\[0\]: expected",
        ),
        (
            "STORE",
            payload_of(STORE, blocks=[16, [1], "", None]),
            r"STORE.blocks.lora_name: expected nil or a string",
        ),
        (
            "STORE",
            payload_of(STORE, blocks=[16, [1, 2], None, [None]]),
            r"STORE.blocks.extra_keys: 1 entries for 2 hashes",
        ),
        (
            "STORE",
            payload_of(STORE, blocks=[16, [1], None, [[{"a": 1}]]]),
            r"STORE.blocks.extra_keys\[0\]\[0\]: expected a scalar",
        ),
        (
            "STORE",
            payload_of(STORE, blocks=[16, [1], None, [[[[1]]]]]),
            r"STORE.blocks.extra_keys\[0\]\[0\]\[0\]: nested too deep",
        ),
        ("STORE", payload_of(STORE, block_ids="ab"), "STORE.block_ids: expected bytes"),
        ("STORE", payload_of(STORE, token_ids=b"\x00" * 6), "STORE.token_ids: 6 bytes is not a whole number"),
        ("STORE", payload_of(STORE, block_ids=b"\x00" * 3), "STORE.block_ids: 3 bytes is not a whole number"),
        ("STORE", payload_of(STORE, instance_id=-7), r"STORE.instance_id: -7 is out of range \[0, 2\^63\)"),
        ("STORE", payload_of(STORE, instance_id=1 << 63), r"STORE.instance_id: .* is out of range"),
        ("RETRIEVE", [*m.encode_payload(RETRIEVE), b""], "RETRIEVE: expected 5 payload fields"),
        (
            "RETRIEVE",
            payload_of(RETRIEVE, instance_id="1"),
            "RETRIEVE.instance_id: expected an integer, got str",
        ),
        (
            "RETRIEVE",
            payload_of(RETRIEVE, instance_id=(1 << 64) - 1),
            "RETRIEVE.instance_id: .* is out of range",
        ),
        ("LOOKUP", [IID, S], r"LOOKUP: expected 4 payload fields \(instance_id, secret, token_ids, key\)"),
        ("LOOKUP", payload_of(LOOKUP, token_ids=b"\x01"), "LOOKUP.token_ids: 1 bytes is not a whole number"),
        ("LOOKUP", payload_of(LOOKUP, token_ids=None), "LOOKUP.token_ids: expected bytes"),
        ("LOOKUP", payload_of(LOOKUP, instance_id=True), "LOOKUP.instance_id: expected an integer, got bool"),
    ],
)
def test_payload_validation(mtype: str, payload: Any, message: str) -> None:
    with pytest.raises(ProtocolError, match=message) as exc:
        decode(mtype, payload)
    assert exc.value.code == "BAD_REQUEST"


def test_too_many_tokens() -> None:
    n = m.MAX_TOKENS_PER_REQUEST + 1
    with pytest.raises(ProtocolError, match=f"LOOKUP.token_ids: {n} ids exceeds the limit"):
        decode("LOOKUP", payload_of(LOOKUP, token_ids=b"\x00" * (4 * n)))


class TestRegister:
    def test_valid_shm(self) -> None:
        reg = decode("REGISTER_KV_CACHE", shm_register()).payload
        assert isinstance(reg, m.Register)
        assert reg.instance_id == IID and reg.model_name == "m"
        assert reg.secret == SECRET
        assert reg.world_size == 2 and reg.worker_id == 1
        assert reg.memory is m.MemoryKind.SHM
        assert reg.kv_shape == (2, 64, 16, 2, 8)
        assert reg.layers[1] == m.ShmLayer("kvwarden-1-0123456789abcdef", 32768, (16384, 256, 16, 8, 1))

    def test_valid_cuda(self) -> None:
        reg = decode("REGISTER_KV_CACHE", shm_register(memory="cuda_ipc", layers=[cuda_layer()])).payload
        assert isinstance(reg, m.Register)
        assert reg.memory is m.MemoryKind.CUDA_IPC
        layer = reg.layers[0]
        assert isinstance(layer, m.CudaLayer)
        assert layer.ipc_handle == b"h" * 64 and layer.event_sync_required is True

    @pytest.mark.parametrize(
        ("over", "message"),
        [
            ({"instance_id": -1}, r"REGISTER_KV_CACHE.instance_id: -1 is out of range"),
            ({"instance_id": 1 << 63}, "REGISTER_KV_CACHE.instance_id: .* is out of range"),
            ({"secret": b"s" * 15}, r"REGISTER_KV_CACHE.secret: 15 bytes is outside \[16, 64\]"),
            ({"secret": None}, "REGISTER_KV_CACHE.secret: expected bytes, got NoneType"),
            ({"model_name": ""}, "REGISTER_KV_CACHE.model_name: length 0"),
            ({"model_name": 5}, "REGISTER_KV_CACHE.model_name: expected a string"),
            ({"world_size": 0}, r"REGISTER_KV_CACHE.world_size: 0 is out of range"),
            ({"worker_id": -1}, r"REGISTER_KV_CACHE.worker_id: -1 is out of range"),
            ({"worker_id": 2}, "REGISTER_KV_CACHE.worker_id: 2 must be < world_size 2"),
            ({"transfer_mode": "engine"}, "REGISTER_KV_CACHE.transfer_mode: 'engine' is not one"),
            ({"memory": "disk"}, "REGISTER_KV_CACHE.memory: 'disk' is not one of shm, cuda_ipc"),
            ({"dtype": "float64"}, "REGISTER_KV_CACHE.dtype: 'float64' is not one of"),
            ({"kv_shape": [2, 64, 16, 2]}, r"REGISTER_KV_CACHE.kv_shape: expected 5 items, got 4"),
            ({"kv_shape": [2, 0, 16, 2, 8]}, r"REGISTER_KV_CACHE.kv_shape\[1\]: 0 is out of range"),
            ({"kv_shape": [3, 64, 16, 2, 8]}, r"kv_shape\[0\]: must be 2 \(K and V\), got 3"),
            ({"owner_pid": -3}, r"REGISTER_KV_CACHE.owner_pid: -3 is out of range"),
            ({"layers": []}, r"REGISTER_KV_CACHE.layers: 0 layers is outside \[1, 1024\]"),
            (
                {"layers": [["kvwarden-1-0123456789abcdef", 0, [1, 1, 1, 1, 1]]] * 1025},
                r"REGISTER_KV_CACHE.layers: 1025 layers is outside \[1, 1024\]",
            ),
            ({"layers": "seg"}, "REGISTER_KV_CACHE.layers: expected an array, got str"),
            ({"layers": [["seg", 0]]}, r"REGISTER_KV_CACHE.layers\[0\]: expected 3 payload"),
            (
                {"layers": [["seg", -1, [1, 1, 1, 1, 1]]]},
                r"REGISTER_KV_CACHE.layers\[0\].offset: -1 is out of range",
            ),
            (
                {"layers": [["seg", 0, [1, 1, 1, 1]]]},
                r"REGISTER_KV_CACHE.layers\[0\].strides: expected 5 items",
            ),
            (
                {"layers": [["seg", 0, [1, 1, 1, 1, -1]]]},
                r"REGISTER_KV_CACHE.layers\[0\].strides\[4\]: -1 is out of range",
            ),
            (
                {"memory": "cuda_ipc", "layers": [cuda_layer(ipc_handle=b"x" * 1025)]},
                r"layers\[0\].ipc_handle: 1025 bytes exceeds the limit of 1024",
            ),
            (
                {"memory": "cuda_ipc", "layers": [cuda_layer(event_sync_required=1)]},
                r"layers\[0\].event_sync_required: expected a boolean",
            ),
            (
                {"memory": "cuda_ipc", "layers": [cuda_layer()[:5]]},
                r"layers\[0\]: expected 11 payload fields",
            ),
            (
                {"memory": "cuda_ipc", "layers": [["seg", 0, [1, 1, 1, 1, 1]]]},
                r"layers\[0\]: expected 11 payload fields",
            ),
        ],
    )
    def test_invalid(self, over: dict[str, Any], message: str) -> None:
        with pytest.raises(ProtocolError, match=message):
            decode("REGISTER_KV_CACHE", shm_register(**over))

    def test_wrong_arity(self) -> None:
        with pytest.raises(ProtocolError, match="REGISTER_KV_CACHE: expected 11 payload fields"):
            decode("REGISTER_KV_CACHE", shm_register()[:-1])


@pytest.mark.parametrize("field", ["transfer_mode", "memory", "dtype"])
def test_a_value_nested_a_thousand_deep_is_refused_naming_the_field(field: str) -> None:
    """The error message shows a bounded repr: a deep value cannot exhaust the stack."""
    deep: Any = None
    for _ in range(1000):
        deep = [deep]
    payload = shm_register(**{field: deep})
    with pytest.raises(
        ProtocolError, match=rf"^REGISTER_KV_CACHE\.{field}: \[\[\[\.\.\.\]\]\] is not one of"
    ):
        decode("REGISTER_KV_CACHE", payload)


# ---------------------------------------------------------------------------- secrets


def type_name(msg: m.Message) -> str:
    return type(msg).__name__


class TestSecret:
    """Every message about an instance carries its secret: 16 to 64 bytes, right after the id."""

    def test_bounds(self) -> None:
        assert m.SECRET_BYTES == (16, 64)

    @pytest.mark.parametrize("msg", INSTANCE_MESSAGES, ids=type_name)
    @pytest.mark.parametrize("size", [16, 17, 63, 64])
    def test_accepts_16_to_64_bytes(self, msg: m.Message, size: int) -> None:
        secret = bytes(range(size))
        req = decode(msg.TYPE, payload_of(msg, secret=secret))
        assert req.payload.secret == secret  # type: ignore[attr-defined]

    @pytest.mark.parametrize("msg", INSTANCE_MESSAGES, ids=type_name)
    @pytest.mark.parametrize("size", [0, 1, 15, 65, 1024])
    def test_rejects_a_secret_outside_16_to_64_bytes(self, msg: m.Message, size: int) -> None:
        with pytest.raises(
            ProtocolError, match=rf"^{msg.TYPE}\.secret: {size} bytes is outside \[16, 64\]$"
        ) as exc:
            decode(msg.TYPE, payload_of(msg, secret=b"s" * size))
        assert exc.value.code == "BAD_REQUEST"

    @pytest.mark.parametrize("msg", INSTANCE_MESSAGES, ids=type_name)
    @pytest.mark.parametrize("secret", ["s" * 16, 16, 1.5, True, [0] * 16, {"s": 1}])
    def test_rejects_a_secret_that_is_not_bytes(self, msg: m.Message, secret: Any) -> None:
        with pytest.raises(
            ProtocolError, match=rf"^{msg.TYPE}\.secret: expected bytes, got {type(secret).__name__}$"
        ) as exc:
            decode(msg.TYPE, payload_of(msg, secret=secret))
        assert exc.value.code == "BAD_REQUEST"

    @pytest.mark.parametrize(
        "msg", [x for x in INSTANCE_MESSAGES if not isinstance(x, m.Ping)], ids=type_name
    )
    def test_a_secret_is_required(self, msg: m.Message) -> None:
        """None is a secret only in a probe PING."""
        with pytest.raises(ProtocolError, match=rf"^{msg.TYPE}\.secret: expected bytes, got NoneType$"):
            decode(msg.TYPE, payload_of(msg, secret=None))

    @pytest.mark.parametrize("msg", INSTANCE_MESSAGES, ids=type_name)
    def test_a_missing_secret_field_is_a_wrong_field_count(self, msg: m.Message) -> None:
        """A payload laid out as in v1 (no secret): the count names the secret among the fields."""
        names = m.field_names(type(msg))
        assert names[:2] == ("instance_id", "secret")
        v1_payload = m.encode_payload(msg)
        del v1_payload[names.index("secret")]
        expected = (
            f"{msg.TYPE}: expected {len(names)} payload fields ({', '.join(names)}), got {len(names) - 1}"
        )
        with pytest.raises(ProtocolError) as exc:
            decode(msg.TYPE, v1_payload)
        assert str(exc.value) == expected
        assert exc.value.code == "BAD_REQUEST"

    def test_ping_probe_has_neither_id_nor_secret(self) -> None:
        assert decode("PING", [None, None]).payload == m.Ping(None, None)

    @pytest.mark.parametrize(
        "payload", [[IID, None], [None, SECRET]], ids=["id-without-secret", "secret-without-id"]
    )
    def test_ping_needs_both_id_and_secret_or_neither(self, payload: list[Any]) -> None:
        with pytest.raises(
            ProtocolError, match=r"^PING\.secret: must be given with an instance_id, and only then$"
        ) as exc:
            decode("PING", payload)
        assert exc.value.code == "BAD_REQUEST"

    def test_ping_secret_is_checked_even_without_an_id(self) -> None:
        with pytest.raises(ProtocolError, match=r"^PING\.secret: 15 bytes is outside \[16, 64\]$"):
            decode("PING", [None, b"s" * 15])
        with pytest.raises(ProtocolError, match=r"^PING\.secret: expected bytes, got str$"):
            decode("PING", [IID, "s" * 16])

    def test_field_checks_run_in_wire_order(self) -> None:
        """A bad id and a bad secret: the id (index 0) is named, then the secret (index 1)."""
        with pytest.raises(ProtocolError, match=r"^STORE\.instance_id: "):
            decode("STORE", payload_of(STORE, instance_id=-1, secret=b""))
        with pytest.raises(ProtocolError, match=r"^STORE\.secret: "):
            decode("STORE", payload_of(STORE, secret=b"", token_ids=None))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=80))
def test_secret_length_property(secret: bytes) -> None:
    """Any bytes of 16 to 64 are a secret (kept as sent); any other length is refused."""
    payload = payload_of(UNREG, secret=secret)
    if 16 <= len(secret) <= 64:
        assert decode("UNREGISTER_KV_CACHE", payload).payload == m.Unregister(IID, secret)
    else:
        with pytest.raises(ProtocolError, match=r"UNREGISTER_KV_CACHE\.secret: .* is outside \[16, 64\]"):
            decode("UNREGISTER_KV_CACHE", payload)
