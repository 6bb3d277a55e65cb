"""Registration floods against a real `kvwarden serve` started with a soft limit of 1,024 open
files (the bench: `tests.reliability.flood_bench`).

A registration flood (REGISTERs of both transfer modes over one connection and over many) meets
``--max-instances-per-connection`` and ``--max-instances`` with LIMIT_EXCEEDED and leaves
nothing behind once the flooders go; with the hard limit down to 1,024 too, registrations past
what the descriptors can hold are refused, not fatal.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from dataplane.client import allocate_kv_caches
from dataplane.server.config import FD_KEEP
from dataplane.wire.errors import LimitExceeded
from dataplane.wire.messages import Ping, Unregister
from tests.dataplane.registration import engine_register_message, register_message, segment_of
from tests.helpers import wait_until
from tests.reliability.flood_bench import (
    code_of,
    dealer,
    end_bench,
    new_worker_works,
    replies,
    send,
    start_bench,
)

PER_CONN = 32  # --max-instances-per-connection of the registration flood
MAX_INSTANCES = 200  # --max-instances of the registration flood

# ------------------------------------------------------------------ registration flood


def register_over(sock: zmq.Socket[Any], caches: list[torch.Tensor], n: int) -> dict[int, tuple[int, bytes]]:
    """Send ``n`` REGISTERs over ``sock``, server-driven and engine-driven in turn, each a new id
    with its own secret; returns request id -> (instance id, secret)."""
    sent = {}
    for k in range(n):
        iid, secret = secrets.randbits(63), secrets.token_bytes(16)
        if k % 2:
            msg: Any = engine_register_message(iid, pool_chunks=1, secret=secret)
        else:
            msg = register_message(iid, caches, "flood", secret=secret)
        sent[send(sock, msg)] = (iid, secret)
    return sent


def flood(
    sock: zmq.Socket[Any], caches: list[torch.Tensor], n: int
) -> tuple[list[str], list[tuple[int, bytes]]]:
    """``n`` REGISTERs over ``sock``: every reply's code, and the instances admitted."""
    sent = register_over(sock, caches, n)
    got = replies(sock, list(sent))
    for r in got.values():  # a refusal names the limit it met
        assert r.ok or "max_instances" in r.body["message"], r
    return [code_of(r) for r in got.values()], [sent[rid] for rid, r in got.items() if r.ok]


def test_registration_flood_meets_the_instance_limits(
    tmp_path: Path, shm_dir: Path, ctx: zmq.Context[Any], timed: bool
) -> None:
    b = start_bench(
        tmp_path,
        shm_dir,
        ctx,
        "--max-instances",
        str(MAX_INSTANCES),
        "--max-instances-per-connection",
        str(PER_CONN),
        timed=timed,
    )
    caches = allocate_kv_caches(1, 2, 16, 1, 8, torch.bfloat16)  # the flood's one tiny cache
    socks: list[zmq.Socket[Any]] = []
    try:
        t0 = time.monotonic()
        # over one connection: the connection's limit answers beyond it
        one = dealer(ctx, b.server.endpoint)
        socks.append(one)
        codes, admitted = flood(one, caches, PER_CONN + 16)
        assert codes.count("OK") == PER_CONN and codes.count("LIMIT_EXCEEDED") == 16, codes
        # over many connections: the server's limit answers beyond it
        many = [dealer(ctx, b.server.endpoint) for _ in range(25)]
        socks += many
        codes = []
        for c, _ in [flood(s, caches, 10) for s in many]:
            codes += c
        flood_s = time.monotonic() - t0
        room = MAX_INSTANCES - 1 - PER_CONN  # the live worker holds one place
        assert codes.count("OK") == room and codes.count("LIMIT_EXCEEDED") == 250 - room, codes
        assert b.tracked() == MAX_INSTANCES
        peak_fds = b.server.fds()

        # at the limit: the registered worker works, /livez answers, a new worker is refused
        b.live_works(1)
        livez = b.livez()
        assert livez[0] == 200
        with pytest.raises(LimitExceeded):
            new_worker_works(b.server.endpoint)

        # the flooders go: half of one connection's instances unregister, the rest just close
        half = admitted[: PER_CONN // 2]
        got = replies(one, [send(one, Unregister(iid, sec)) for iid, sec in half])
        assert all(r.ok and r.body == {"removed": True} for r in got.values()), got
        t_close = time.monotonic()
        for s in socks:
            s.close(linger=0)
        wait_until(lambda: b.tracked() == 1, 15, what="every flood instance released")
        gone_s = time.monotonic() - t_close
        # their pools and mappings went with them
        wait_until(lambda: b.server.fds() <= b.base_fds + 2, 10, what="the server's descriptors back")
        left = sorted(
            p.name for p in shm_dir.iterdir() if not p.name.startswith(f"kvwarden-{b.server.proc.pid}-")
        )
        assert left == sorted([*b.live.info["segments"], segment_of(caches)]), left  # (and the L1 arena)
        new_worker_works(b.server.endpoint)
        new_worker_works(b.server.endpoint, "engine_driven")
        b.live_works(2)
        b.notes.append(
            f"registration flood: {PER_CONN + 16 + 250} REGISTERs in {flood_s:.2f}s, {MAX_INSTANCES} "
            f"tracked at the peak; server fds {b.base_fds} -> {peak_fds} -> {b.server.fds()}; all "
            f"released {gone_s:.2f}s after the close; /livez at the peak {livez[0]} in "
            f"{livez[1] * 1000:.0f} ms"
        )
        end_bench(b)
    finally:
        for s in socks:
            s.close(linger=0)
        b.close()


def test_registration_flood_past_the_descriptors_is_refused_not_fatal(
    tmp_path: Path, shm_dir: Path, ctx: zmq.Context[Any], timed: bool
) -> None:
    """A hard limit of 1,024 descriptors and the default --max-instances (4,096, far more than
    the descriptors can hold): registrations are refused with LIMIT_EXCEEDED naming the
    descriptors while the server keeps some free, so connections are still accepted."""
    b = start_bench(tmp_path, shm_dir, ctx, hard=1024, timed=timed)
    need = 2 * 4096 + (1024 - FD_KEEP) // 2 + 128  # the instances' descriptors, the cap's, the reserve
    assert f"below the {need} that max_instances 4096 beside max_connections" in b.server.output()
    caches = allocate_kv_caches(1, 2, 16, 1, 8, torch.bfloat16)
    socks = [dealer(ctx, b.server.endpoint) for _ in range(24)]
    try:
        codes: list[str] = []
        refusals: list[str] = []
        for s in socks:  # 24 x 48 REGISTERs: more than 1,024 descriptors could hold
            got = replies(s, list(register_over(s, caches, 48)))
            codes += [code_of(r) for r in got.values()]
            refusals += [r.body["message"] for r in got.values() if not r.ok]
        assert set(codes) == {"OK", "LIMIT_EXCEEDED"}, sorted(set(codes))
        assert all("file descriptors" in m for m in refusals), refusals[:3]
        assert b.server.fds() <= 1024 - 100  # the reserve was kept
        fresh = dealer(ctx, b.server.endpoint)  # a new connection is accepted and answered
        socks.append(fresh)
        assert replies(fresh, [send(fresh, Ping(None, None))])
        b.live_works(1)
        assert b.livez()[0] == 200
        for s in socks:
            s.close(linger=0)
        wait_until(lambda: b.tracked() == 1, 20, what="every flood instance released")
        new_worker_works(b.server.endpoint)
        b.notes.append(f"descriptor flood: {codes.count('OK')} admitted, {len(refusals)} refused")
        end_bench(b)
    finally:
        for s in socks:
            s.close(linger=0)
        b.close()
