"""A worker's paged KV memory as the server sees it, and the chunk copy kernels.

Each layer is a contiguous ``[2, num_blocks, block_size, heads, head_dim]`` tensor. On CPU it
lives in a shared-memory segment the server maps; on CUDA it is opened from an IPC handle.
When all layers sit in one segment at a constant stride (what ``allocate_kv_caches`` makes),
one strided view spans every layer and a chunk moves with one copy per run of consecutive
slots, instead of one per layer and block.

A chunk is stored token-major: ``[layers, 2, chunk_tokens, heads * head_dim]``.
"""

from __future__ import annotations

import errno
import itertools
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from dataplane.memory.copies import _MAX_RUNS, Blocks, CopySplitter, Placement, slot_runs, whole_blocks
from dataplane.memory.shm import Segment
from dataplane.wire.errors import InvalidLayout, LimitExceeded
from dataplane.wire.messages import CudaLayer, MemoryKind, Register, ShmLayer

logger = logging.getLogger(__name__)

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
# errors that say the server ran out of something (descriptors, memory, address space)
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


@dataclass
class MappedKV:
    """The server's mapping of one registered KV cache."""

    memory: MemoryKind
    dtype: torch.dtype
    num_layers: int
    num_blocks: int
    block_size: int
    heads: int
    head_dim: int
    # per layer: [2, num_blocks * block_size, heads * head_dim]
    layers: list[torch.Tensor]
    # all layers: [L, 2, num_blocks * block_size, heads * head_dim], or None
    stacked: torch.Tensor | None
    segments: list[Segment] = field(default_factory=list)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # per layer, K then V: the worker's memory as flat bytes (built on first use: `chunk_views`)
    _planes: list[memoryview] | None = field(default=None, repr=False)

    @property
    def token_row(self) -> int:
        return self.heads * self.head_dim

    def chunk_nbytes(self, n_tokens: int) -> int:
        return self.num_layers * 2 * n_tokens * self.token_row * _itemsize(self.dtype)

    def chunk_views(self, where: Placement, max_views: int = 4096) -> list[memoryview] | None:
        """Where the chunk at ``where`` lives, as writable byte views of the worker's memory in
        the chunk's order (layer, K then V, token): a chunk file read in place lands there.
        None on a GPU, or when the chunk lies in more than ``max_views`` pieces."""
        if self.device.type != "cpu":
            return None
        row = self.token_row * _itemsize(self.dtype)
        if isinstance(where, Blocks):
            runs, unit = slot_runs(where.ids), self.block_size * row
        else:
            runs, unit = slot_runs(where), row
        if 2 * self.num_layers * len(runs) > max_views:
            return None
        if self._planes is None:
            layers = self.layers if self.stacked is None else list(self.stacked)
            planes = (layer[k].view(torch.uint8).numpy() for layer in layers for k in (0, 1))
            self._planes = [p.data.cast("B") for p in planes]
        return [p[src * unit : (src + n) * unit] for p in self._planes for _, src, n in runs]

    def _views(self, buf: torch.Tensor, n_tokens: int) -> torch.Tensor:
        return buf.view(self.dtype).view(self.num_layers, 2, n_tokens, self.token_row)

    def gather(self, where: Placement, buf: torch.Tensor, splitter: CopySplitter | None = None) -> None:
        """Copy the chunk at ``where`` (token slots, block * block_size + offset, or whole
        `Blocks`) into the chunk ``buf``."""
        self._move(where, buf, True, splitter)

    def scatter(self, where: Placement, buf: torch.Tensor, splitter: CopySplitter | None = None) -> None:
        self._move(where, buf, False, splitter)

    def _move(
        self, where: Placement, buf: torch.Tensor, to_chunk: bool, splitter: CopySplitter | None
    ) -> None:
        if isinstance(where, Blocks) and len(where.ids) and where.ids.min() < 0:
            raise ValueError("token-major memory has no blocks to leave alone (-1)")
        cpu = self.device.type == "cpu"
        if not cpu:
            self._move_gpu(where.slots() if isinstance(where, Blocks) else where, buf, to_chunk)
            return
        if isinstance(where, Blocks):
            self._move_blocks(where.ids, buf, to_chunk, splitter)
            return
        slots = where.slots() if isinstance(where, Blocks) else where
        blocks = whole_blocks(slots, self.block_size)
        if blocks is not None:
            self._move_blocks(blocks, buf, to_chunk, splitter)
            return
        chunk = self._views(buf, len(slots))
        runs = slot_runs(slots)
        idx = torch.from_numpy(slots.astype(np.int64)) if len(runs) > _MAX_RUNS else None

        def layers(lo: int, hi: int) -> None:
            if self.stacked is not None:
                pairs = [(self.stacked[lo:hi], chunk[lo:hi])]
            else:
                pairs = [(self.layers[i], chunk[i]) for i in range(lo, hi)]
            for kv, part in pairs:
                if idx is not None:
                    dim = kv.dim() - 2
                    if to_chunk:
                        part.copy_(kv.index_select(dim, idx))
                    else:
                        kv.index_copy_(dim, idx, part)
                    continue
                for dst, src, n in runs:
                    if to_chunk:
                        part.narrow(-2, dst, n).copy_(kv.narrow(-2, src, n))
                    else:
                        kv.narrow(-2, src, n).copy_(part.narrow(-2, dst, n))

        if splitter is None:
            layers(0, self.num_layers)
        else:
            splitter.run(layers, self.num_layers)

    def _move_gpu(self, slots: np.ndarray, buf: torch.Tensor, to_chunk: bool) -> None:
        """A chunk between GPU memory and the host buffer ``buf`` (L1: pinned), through a staging
        chunk on the GPU: the slots gathered (or scattered) there by one indexed kernel per layer,
        and the bytes crossing the bus in one copy. One copy per run of slots instead, each a
        synchronous transfer of a block's few KiB, moved 1 GB/s on an H200 host."""
        chunk = self._views(buf, len(slots))
        with torch.cuda.device(self.device):
            idx = torch.from_numpy(slots.astype(np.int64)).to(self.device)
            stage = torch.empty(chunk.shape, dtype=self.dtype, device=self.device)
            if to_chunk:
                for i, kv in enumerate(self.layers):
                    torch.index_select(kv, 1, idx, out=stage[i])
                chunk.copy_(stage)
            else:
                stage.copy_(chunk)
                for i, kv in enumerate(self.layers):
                    kv.index_copy_(1, idx, stage[i])
            torch.cuda.synchronize(self.device)

    def _move_blocks(
        self, blocks: np.ndarray, buf: torch.Tensor, to_chunk: bool, splitter: CopySplitter | None
    ) -> None:
        """Whole blocks on the CPU, as bytes: a gather is one ``index_select`` per layer (or per
        range of stacked layers), a scatter one numpy indexed assignment; both copy each block's
        bytes once, with the GIL released (a copy per run of slots pays ~5 us of overhead each,
        which halved the throughput of 16-token blocks)."""
        bb = self.block_size * self.token_row * _itemsize(self.dtype)
        nb = self.num_blocks
        out = buf.view(torch.uint8).view(self.num_layers, 2, len(blocks), bb)
        idx = torch.from_numpy(blocks)

        def layers(lo: int, hi: int) -> None:
            if self.stacked is not None:
                pairs = [(self.stacked[lo:hi].view(torch.uint8).view(hi - lo, 2, nb, bb), out[lo:hi])]
            else:
                pairs = [(self.layers[i].view(torch.uint8).view(2, nb, bb), out[i]) for i in range(lo, hi)]
            for kv, part in pairs:
                if to_chunk:
                    torch.index_select(kv, kv.dim() - 2, idx, out=part)
                else:
                    kv.numpy()[..., blocks, :] = part.numpy()

        if splitter is None:
            layers(0, self.num_layers)
        else:
            splitter.run(layers, self.num_layers)

    def release(self) -> bool:
        """Drop every view and unmap; True when every mapping closed now."""
        self._planes = None  # (views of the segments: dropped before they close)
        self.layers = []
        self.stacked = None
        closed = True
        for seg in self.segments:
            closed = seg.close() and closed
        return closed


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def map_registration(reg: Register) -> MappedKV:
    """Build the server's view of a worker's KV memory, validating every bound."""
    dtype = TORCH_DTYPES[reg.dtype]
    two, nb, bs, heads, hd = reg.kv_shape
    shape = (two, nb, bs, heads, hd)
    want = contiguous_strides(shape)
    item = _itemsize(dtype)
    layer_elems = 2 * nb * bs * heads * hd
    for i, layer in enumerate(reg.layers):
        if tuple(layer.strides) != want:
            raise InvalidLayout(f"layer {i}: strides {list(layer.strides)} are not contiguous {list(want)}")
    if reg.memory == MemoryKind.SHM:
        return _map_shm(reg, dtype, item, layer_elems)
    return _map_cuda(reg, dtype, item, layer_elems)


def _map_shm(reg: Register, dtype: torch.dtype, item: int, layer_elems: int) -> MappedKV:
    _, nb, bs, heads, hd = reg.kv_shape
    layer_bytes = layer_elems * item
    shm_layers = [lay for lay in reg.layers if isinstance(lay, ShmLayer)]
    assert len(shm_layers) == len(reg.layers)
    segments: dict[str, Segment] = {}
    try:
        _attach_segments(shm_layers, item, layer_bytes, segments)
        flat = {name: seg.as_tensor() for name, seg in segments.items()}
        layers = [
            flat[lay.segment][lay.offset : lay.offset + layer_bytes].view(dtype).view(2, nb * bs, heads * hd)
            for lay in shm_layers
        ]
        stacked = None
        if len(segments) == 1 and len(shm_layers) > 1:
            stacked = _stacked_view(flat[shm_layers[0].segment].view(dtype), shm_layers, reg.kv_shape, item)
        elif len(shm_layers) == 1:
            stacked = layers[0].unsqueeze(0)
        del flat
        if stacked is not None:
            layers = []  # the stacked view serves every layer: keep no per-layer views
        segs = list(segments.values())
        return MappedKV(MemoryKind.SHM, dtype, len(shm_layers), nb, bs, heads, hd, layers, stacked, segs)
    except BaseException:
        for seg in segments.values():
            seg.close()
        raise


def _attach_segments(
    layers: list[ShmLayer], item: int, layer_bytes: int, segments: dict[str, Segment]
) -> None:
    """Attach every segment the layers name (into ``segments``), checking each layer's bounds.
    Every refusal of ``Segment.attach`` (a symbolic link, not a regular file, another uid's,
    sparse, too small, cannot be opened or mapped) is an InvalidLayout naming the layer."""
    for i, layer in enumerate(layers):
        if layer.offset % item:
            raise InvalidLayout(f"layer {i}: offset {layer.offset} is not {item}-byte aligned")
        seg = segments.get(layer.segment)
        if seg is None:
            try:
                seg = Segment.attach(layer.segment, layer.offset + layer_bytes)
            except FileNotFoundError:
                raise InvalidLayout(f"layer {i}: segment {layer.segment} does not exist") from None
            except ValueError as exc:
                raise InvalidLayout(f"layer {i}: {exc}") from None
            except OSError as exc:
                reason = exc.strerror or str(exc)
                if exc.errno in _OUT_OF_RESOURCES:  # the server's limit, not the layout's fault
                    raise LimitExceeded(
                        f"cannot map segment {layer.segment}: {reason}", "descriptors"
                    ) from None
                raise InvalidLayout(f"layer {i}: cannot map segment {layer.segment}: {reason}") from None
            segments[layer.segment] = seg
        if layer.offset + layer_bytes > seg.size:
            raise InvalidLayout(
                f"layer {i}: bytes [{layer.offset}, {layer.offset + layer_bytes}) exceed "
                f"segment {layer.segment} of {seg.size} bytes"
            )


def _stacked_view(
    base: torch.Tensor, layers: list[ShmLayer], kv_shape: tuple[int, ...], item: int
) -> torch.Tensor | None:
    """One strided view over every layer when they sit at a constant stride in one segment."""
    _, nb, bs, heads, hd = kv_shape
    offs = [lay.offset for lay in layers]
    step = offs[1] - offs[0]
    layer_bytes = 2 * nb * bs * heads * hd * item
    if step < layer_bytes or step % item or any(b - a != step for a, b in itertools.pairwise(offs)):
        return None
    return base.as_strided(
        (len(offs), 2, nb * bs, heads * hd),
        (step // item, nb * bs * heads * hd, heads * hd, 1),
        offs[0] // item,
    )


def _map_cuda(reg: Register, dtype: torch.dtype, item: int, layer_elems: int) -> MappedKV:
    """Open each layer's CUDA IPC handle (the fields of ``storage._share_cuda_()``)."""
    if not torch.cuda.is_available():
        raise InvalidLayout("memory 'cuda_ipc' needs a CUDA device on the server host")
    _, nb, bs, heads, hd = reg.kv_shape
    layers: list[torch.Tensor] = []
    device = torch.device("cuda")
    for i, layer in enumerate(reg.layers):
        assert isinstance(layer, CudaLayer)
        device = _device_for_uuid(layer.device_uuid, layer.device_index)
        if layer.tensor_offset % item or layer.tensor_offset + layer_elems * item > layer.storage_nbytes:
            raise InvalidLayout(f"layer {i}: layout exceeds its IPC storage")
        try:
            with torch.cuda.device(device):
                storage = torch.UntypedStorage._new_shared_cuda(  # type: ignore[attr-defined]
                    device.index,
                    layer.ipc_handle,
                    layer.storage_nbytes,
                    layer.storage_offset,
                    layer.ref_counter_handle,
                    layer.ref_counter_offset,
                    layer.event_handle or None,
                    layer.event_sync_required,
                )
        except RuntimeError as exc:  # (torch.AcceleratorError is one) a handle CUDA refuses
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise InvalidLayout(f"layer {i}: cannot open its CUDA IPC handle on {device}: {why}") from None
        t = torch.empty(0, dtype=dtype, device=device).set_(
            storage,
            layer.tensor_offset // item,
            (2, nb * bs, heads * hd),
            (nb * bs * heads * hd, heads * hd, 1),
        )
        layers.append(t)
    return MappedKV(MemoryKind.CUDA_IPC, dtype, len(layers), nb, bs, heads, hd, layers, None, [], device)


def _device_for_uuid(uuid: str, index: int) -> torch.device:
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        if str(getattr(props, "uuid", "")) == uuid:
            return torch.device("cuda", i)
    if index < torch.cuda.device_count():
        logger.warning("kvmemory: device uuid %s not found, using cuda:%d", uuid, index)
        return torch.device("cuda", index)
    raise InvalidLayout(f"no CUDA device with uuid {uuid} on the server host")


def map_local_tensors(caches: list[torch.Tensor]) -> MappedKV:
    """A MappedKV over a worker's own per-layer tensors (engine-driven copies, client side)."""
    first = caches[0]
    _, nb, bs, heads, hd = first.shape
    layers = [t.view(2, nb * bs, heads * hd) for t in caches]
    stacked = None
    base = first.untyped_storage().data_ptr()
    one_storage = all(t.untyped_storage().data_ptr() == base for t in caches)
    if len(caches) > 1 and first.device.type == "cpu" and one_storage:
        item = first.element_size()
        ptrs = [t.data_ptr() for t in caches]
        step = ptrs[1] - ptrs[0]
        if step > 0 and step % item == 0 and all(b - a == step for a, b in itertools.pairwise(ptrs)):
            stacked = first.as_strided(
                (len(caches), 2, nb * bs, heads * hd),
                (step // item, nb * bs * heads * hd, heads * hd, 1),
                first.storage_offset(),
            )
    return MappedKV(
        MemoryKind.SHM, first.dtype, len(caches), nb, bs, heads, hd, layers, stacked, [], first.device
    )
