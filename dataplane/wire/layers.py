"""The memory a REGISTER_KV_CACHE names, one descriptor per layer: a shared-memory segment's
(``ShmLayer``) or a CUDA IPC allocation's (``CudaLayer``); the record's ``memory`` field says
which kind all of its layers are."""

from __future__ import annotations

import dataclasses
from typing import Annotated

from dataplane.wire.checks import INT64_MAX, blob, boolean, int_list, name, small_int
from dataplane.wire.records import Record

_STRIDES = int_list(5, 0, INT64_MAX)
_OFFSET = small_int(0, INT64_MAX)
_HANDLE = blob(1024)


@dataclasses.dataclass(frozen=True, slots=True)
class ShmLayer(Record):
    segment: Annotated[str, name, "/dev/shm/<segment>: kvwarden-<pid>-<16 hex digits>"]
    offset: Annotated[int, _OFFSET, "bytes from the start of the segment, a multiple of the element size"]
    strides: Annotated[tuple[int, ...], _STRIDES, "in elements: the contiguous strides of kv_shape"]


@dataclasses.dataclass(frozen=True, slots=True)
class CudaLayer(Record):
    device_uuid: Annotated[str, name]
    device_index: Annotated[int, small_int(0, 1024)]
    ipc_handle: Annotated[bytes, _HANDLE]
    storage_nbytes: Annotated[int, _OFFSET]
    storage_offset: Annotated[int, _OFFSET, "bytes of the storage inside its IPC allocation"]
    tensor_offset: Annotated[int, _OFFSET, "bytes of the layer inside its storage"]
    ref_counter_handle: Annotated[bytes, _HANDLE]
    ref_counter_offset: Annotated[int, _OFFSET]
    event_handle: Annotated[bytes, _HANDLE]
    event_sync_required: Annotated[bool, boolean]
    strides: Annotated[tuple[int, ...], _STRIDES, "in elements"]
