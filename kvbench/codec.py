"""`kvwarden bench codec`: the lossless coding of 16-bit chunks (`dataplane.storage.compress`)
beside the alternatives and memcpy, and what it does to a hit of the remote tier.

For each kind of KV (a random-weight model's kind: normal values with a scale per channel; and,
with ``--kv-file``, KV captured from a trained model, `scripts/capture_kv.py`): the bytes a chunk
takes coded (kvwarden's planes; blosc2's byte shuffle with zstd and with lz4; the bound the
exponents' entropy sets), and encode and decode GB/s on one core beside memcpy (medians); and
a 256-token chunk of every layer quantized to int8 (``kv_compression``): its bytes, quantize and
dequantize GB/s on one core, and its error. Then
a chunk stored through a real ``redis-server`` on loopback, coded and not, and read back into a
buffer: the time of each read (median), first and steady.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvbench.movers import start_redis
from kvbench.results import add_output_args, finish, resolve


def add_args(sub: Any) -> None:
    p = sub.add_parser("codec", help="lossless chunk coding: bytes, GB/s a core vs memcpy, Redis hits")
    p.add_argument("--chunk-mb", type=int, default=None, help="chunk size in MiB (16; quick 8)")
    p.add_argument("--rounds", type=int, default=None, help="samples of each figure (9; quick 5)")
    p.add_argument("--kv-file", default=None, help="a .npy of bfloat16 KV (as int16/uint16 bits)")
    p.add_argument(
        "--link-gbit",
        type=float,
        action="append",
        default=[],
        help="also read Redis over a loopback shaped to this many Gbit/s (a network namespace: root)",
    )
    add_output_args(p)
    p.set_defaults(func=run_codec)


def _median(f: Callable[[], Any], n: int) -> float:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def synthetic_kv(nbytes: int, seed: int = 0) -> np.ndarray:
    """bfloat16 bits of KV-like values: normal, a scale per channel of 64 (a random-weight
    model's KV is of this kind)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(nbytes // 128, 64, generator=g) * (torch.rand(64, generator=g) * 4 + 0.1)
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8).ravel().copy()


def trained_kv(path: str, nbytes: int) -> np.ndarray:
    """The first ``nbytes`` of the KV captured in ``path`` (`scripts/capture_kv.py`), as bytes."""
    kv: np.ndarray = np.load(path).view(np.uint8).ravel()[:nbytes].copy()
    return kv


def entropy_bound(raw: np.ndarray) -> float:
    """The ratio at best when the 8 exponent bits of each bfloat16 are coded at their entropy."""
    w = raw.view(np.uint16)
    p = np.bincount(((w >> 7) & 0xFF).astype(np.uint8), minlength=256) / w.size
    bits = float(-(p[p > 0] * np.log2(p[p > 0])).sum())
    return 16 / (8 + bits)


def measure_kind(raw: np.ndarray, rounds: int) -> dict[str, Any]:
    import blosc2

    from dataplane.storage.compress.planes import decode_into, encode, numpy_passes

    n = raw.nbytes
    out = np.empty_like(raw)
    mv = raw.data.cast("B")
    memcpy = n / _median(lambda: np.copyto(out, raw), rounds) / 1e9
    coded = encode(mv, "bfloat16")
    assert coded is not None
    dest = out.data.cast("B")
    rows = {
        "planes": {
            "ratio": n / len(coded),
            "encode_gbs": n / _median(lambda: encode(mv, "bfloat16"), rounds) / 1e9,
            "decode_gbs": n / _median(lambda: decode_into(coded, dest), rounds) / 1e9,
        }
    }
    with numpy_passes():  # (what a process codes at before its kernels are compiled)
        rows["planes_numpy_passes"] = {
            "ratio": n / len(coded),
            "encode_gbs": n / _median(lambda: encode(mv, "bfloat16"), rounds) / 1e9,
            "decode_gbs": n / _median(lambda: decode_into(coded, dest), rounds) / 1e9,
        }
    assert bytes(out) == bytes(raw)
    blosc2.set_nthreads(1)
    for name, codec in (("blosc2_zstd_shuffle", blosc2.Codec.ZSTD), ("blosc2_lz4_shuffle", blosc2.Codec.LZ4)):
        params = {"codec": codec, "clevel": 1, "typesize": 2, "filters": [blosc2.Filter.SHUFFLE]}
        c = blosc2.compress2(raw, **params)
        rows[name] = {
            "ratio": n / len(c),
            "encode_gbs": n / _median(lambda p=params: blosc2.compress2(raw, **p), rounds) / 1e9,  # type: ignore[misc]
            "decode_gbs": n / _median(lambda c=c: blosc2.decompress2(c), rounds) / 1e9,  # type: ignore[misc]
        }
    return {"bytes": n, "memcpy_gbs": memcpy, "entropy_bound": entropy_bound(raw), "codecs": rows}


INT8_TOKENS = 256  # an int8 chunk as `bench quality` serves it: 256 tokens of every layer


def measure_int8(kv: np.ndarray, layers: int, channels: int, rounds: int) -> dict[str, Any]:
    """The int8 codec (`dataplane.memory.int8`) on one token-major chunk of ``kv`` (bfloat16
    bits ``[layers, 2, tokens, channels]``): bytes, and quantize and dequantize GB/s on one
    core beside memcpy, and the round trip's error relative to the values' RMS (K and V)."""
    import torch

    from dataplane.memory.int8 import Int8Codec, Int8Shape
    from dataplane.wire.kinds import KVFormat

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        raw = torch.from_numpy(kv.view(np.int16).copy()).view(torch.bfloat16).flatten()
        shape = Int8Shape(KVFormat.TOKEN_MAJOR, layers, 1, channels, 16)
        codec = Int8Codec(shape)
        packed = torch.empty(shape.chunk_nbytes(INT8_TOKENS), dtype=torch.uint8)
        out = torch.empty_like(raw)
        n = raw.numel() * 2
        enc = _median(lambda: codec.encode(raw, packed, INT8_TOKENS), rounds)
        dec = _median(lambda: codec.decode(packed, out, INT8_TOKENS), rounds)
        memcpy = _median(lambda: out.copy_(raw), rounds)
        codec.decode(packed, out, INT8_TOKENS)
        x = raw.float().view(layers, 2, INT8_TOKENS, channels)
        err = out.float().view(layers, 2, INT8_TOKENS, channels) - x
        rel = [float(err[:, i].pow(2).mean().sqrt() / x[:, i].pow(2).mean().sqrt()) for i in (0, 1)]
    finally:
        torch.set_num_threads(threads)
    return {
        "bytes": n,
        "int8_bytes": packed.numel(),
        "ratio": n / packed.numel(),
        "encode_gbs": n / enc / 1e9,
        "decode_gbs": n / dec / 1e9,
        "memcpy_gbs": n / memcpy / 1e9,
        "rms_error_k": rel[0],
        "rms_error_v": rel[1],
    }


def int8_chunk(kinds: dict[str, np.ndarray], kv_file: str | None) -> dict[str, tuple[np.ndarray, int, int]]:
    """Each kind of KV as a token-major chunk for `measure_int8`: (bits, layers, channels).
    The random-weight kind as SmolLM2's shape (30 layers, 3 heads of 64); the captured KV
    (``[layers x K/V, 1, heads, tokens, head_dim]``) as it is."""
    out = {}
    need = 30 * 2 * INT8_TOKENS * 192 * 2
    synth = synthetic_kv(need, seed=1).view(np.uint16)
    out["random_weight_kind"] = (synth.reshape(30, 2, INT8_TOKENS, 192), 30, 192)
    if kv_file:
        kv = np.load(kv_file).view(np.uint16)  # [2L, 1, H, T, D]
        two_l, _, h, t, d = kv.shape
        if t >= INT8_TOKENS:
            chunk = kv[:, 0, :, :INT8_TOKENS, :].reshape(two_l // 2, 2, h, INT8_TOKENS, d)
            chunk = np.ascontiguousarray(chunk.transpose(0, 1, 3, 2, 4)).reshape(
                two_l // 2, 2, INT8_TOKENS, h * d
            )
            out["trained"] = (chunk, two_l // 2, h * d)
    return out


def measure_redis(raw: np.ndarray, rounds: int) -> dict[str, Any]:
    """A chunk through a real redis-server, stored coded and raw, read back into one buffer."""
    from dataplane.storage.remote import RemoteBackend

    pair = start_redis()
    if pair is None:
        raise SystemExit("bench codec: redis-server is not installed (make tools)")
    proc, client = pair
    url = f"redis://127.0.0.1:{client.connection_pool.connection_kwargs['port']}/0"
    n = raw.nbytes
    dest = bytearray(n)
    out: dict[str, Any] = {}
    try:
        for i, setting in enumerate(("none", "lossless")):
            b = RemoteBackend(url, timeout_s=30, compression=setting, queue_bytes=n + 1)
            b.start()
            try:
                key = (i + 1).to_bytes(16, "big")
                assert b.put(key, "uint8", (n,), raw.data.cast("B"), words="bfloat16")
                assert b.flush(60)

                def get(b: RemoteBackend = b, key: bytes = key) -> None:
                    b.get(key, "uint8", (n,), alloc=lambda _: memoryview(dest))

                t0 = time.perf_counter()
                get()
                first = time.perf_counter() - t0
                assert bytes(dest) == raw.tobytes()
                out[setting] = {
                    "stored_bytes": b.stats().bytes_written,
                    "first_s": first,
                    "steady_s": _median(get, rounds),
                }
            finally:
                b.stop()
                b.join(10)
                b.close()
    finally:
        client.close()
        proc.kill()
        proc.wait(10)
    out["coded_over_raw_time"] = out["lossless"]["steady_s"] / out["none"]["steady_s"]
    return out


def _over_link(gbit: float, n: int, kv_file: str | None, rounds: int) -> dict[str, Any]:
    """`measure_redis` run again in a network namespace whose loopback is shaped to ``gbit``."""
    import json
    import subprocess

    from kvbench.netns import shaped_loopback

    argv = [sys.executable, "-m", "kvbench.codec", str(n), str(rounds), kv_file or ""]
    with shaped_loopback(gbit) as inside:
        done = subprocess.run([*inside, *argv], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"bench codec over {gbit:g} Gbit/s: {done.stderr.strip()[-2000:]}")
    return dict(json.loads(done.stdout.splitlines()[-1]))


def _redis_only(argv: list[str]) -> None:
    """`python -m kvbench.codec N ROUNDS [KV_FILE]`: `measure_redis` alone, its JSON on stdout
    (what `_over_link` runs inside the namespace)."""
    import json

    from dataplane.storage.compress import WARMUP

    n, rounds, kv_file = int(argv[0]), int(argv[1]), argv[2] if len(argv) > 2 else ""
    WARMUP.start()
    WARMUP.join()
    raw = trained_kv(kv_file, n) if kv_file else synthetic_kv(n)
    print(json.dumps(measure_redis(raw, rounds)))


def run_codec(ns: argparse.Namespace) -> int:
    from dataplane.storage.compress import WARMUP

    resolve(ns, chunk_mb=(16, 8, 1), rounds=(9, 5, 2))
    if ns.link_gbit:
        from kvbench.netns import unavailable

        why = unavailable()
        if why is not None or any(not 0 < g <= 400 for g in ns.link_gbit):
            print(f"bench codec: --link-gbit between 0 and 400, and it {why or 'is fine'}", file=sys.stderr)
            return 2
    t0 = time.perf_counter()
    WARMUP.start()  # (the planes' kernels: compiled, or loaded from numba's cache, before timing)
    WARMUP.join()
    compile_s = time.perf_counter() - t0
    if not WARMUP.ready:
        raise SystemExit(f"bench codec: the planes' kernels are {WARMUP.state}")
    n = int(ns.chunk_mb) << 20
    kinds = {"random_weight_kind": synthetic_kv(n)}
    if ns.kv_file:
        kinds["trained"] = trained_kv(ns.kv_file, n)
    report: dict[str, Any] = {"kinds": {k: measure_kind(v, ns.rounds) for k, v in kinds.items()}}
    report["int8"] = {
        k: measure_int8(v, lay, ch, ns.rounds) for k, (v, lay, ch) in int8_chunk(kinds, ns.kv_file).items()
    }
    report["redis"] = measure_redis(kinds.get("trained", kinds["random_weight_kind"]), ns.rounds)
    report["redis_links"] = {f"{g:g}": _over_link(g, n, ns.kv_file, ns.rounds) for g in ns.link_gbit}
    report["kernels_ready_s"] = compile_s
    report["params"] = {"chunk_mb": ns.chunk_mb, "rounds": ns.rounds, "kv_file": ns.kv_file}
    finish(ns, "codec", report, _show)
    return 0


def _show(rep: dict[str, Any]) -> None:
    print(
        f"planes' kernels ready in {rep['kernels_ready_s']:.2f} s (numba: compiled, or loaded from its cache)"
    )
    for kind, k in rep["kinds"].items():
        mib, bound = k["bytes"] >> 20, k["entropy_bound"]
        print(f"{kind}: {mib} MiB, memcpy {k['memcpy_gbs']:.2f} GB/s, entropy bound {bound:.3f}x")
        for name, c in k["codecs"].items():
            print(
                f"  {name:22s} {c['ratio']:.3f}x  encode {c['encode_gbs']:.2f} GB/s  "
                f"decode {c['decode_gbs']:.2f} GB/s ({c['decode_gbs'] / k['memcpy_gbs']:.2f}x memcpy)"
            )
    for kind, q in rep.get("int8", {}).items():
        print(
            f"{kind}: int8 (kv_compression) {q['ratio']:.3f}x ({q['bytes']:,} -> {q['int8_bytes']:,} bytes)  "
            f"quantize {q['encode_gbs']:.2f} GB/s  dequantize {q['decode_gbs']:.2f} GB/s "
            f"(memcpy {q['memcpy_gbs']:.2f})  "
            f"RMS error K {100 * q['rms_error_k']:.2f}% V {100 * q['rms_error_v']:.2f}%"
        )
    r = rep["redis"]
    for setting in ("none", "lossless"):
        s = r[setting]
        print(
            f"redis {setting:8s}: {s['stored_bytes']} bytes stored, read first {s['first_s'] * 1e3:.1f} ms, "
            f"steady {s['steady_s'] * 1e3:.1f} ms"
        )
    print(f"redis hit, coded / raw time: {r['coded_over_raw_time']:.2f}x")
    for gbit, r in rep.get("redis_links", {}).items():
        print(
            f"redis over {gbit} Gbit/s: raw {r['none']['steady_s'] * 1e3:.1f} ms "
            f"(first {r['none']['first_s'] * 1e3:.1f}), coded {r['lossless']['steady_s'] * 1e3:.1f} ms "
            f"(first {r['lossless']['first_s'] * 1e3:.1f}): coded / raw {r['coded_over_raw_time']:.2f}x"
        )


if __name__ == "__main__":
    _redis_only(sys.argv[1:])
