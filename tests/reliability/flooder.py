"""A connection flooder of its own process, for the flood tests.

``python -m tests.reliability.flooder HOST PORT --zmq N --raw M`` raises its soft limit on open
files, opens N idle ZMQ DEALER connections and M raw TCP connections (which never speak ZMTP) to
HOST:PORT, prints ``open``, and holds them until a line arrives on stdin; then it closes them
all, prints ``closed`` and exits 0. A DEALER whose connection the server closes reconnects on its
own (libzmq, every 100 ms), as a real client's would; a raw connection closed by the server stays
closed.
"""

from __future__ import annotations

import argparse
import resource
import socket
import sys
from typing import Any

import zmq


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="flooder")
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("--zmq", type=int, default=0, help="idle DEALER connections")
    p.add_argument("--raw", type=int, default=0, help="raw TCP connections")
    ns = p.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * ns.zmq + ns.raw + 256
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (need if hard == resource.RLIM_INFINITY else min(need, hard), hard)
        )
    ctx: zmq.Context[Any] = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, ns.zmq + 64)
    dealers: list[zmq.Socket[Any]] = []
    raws: list[socket.socket] = []
    try:
        for _ in range(ns.zmq):
            s: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://{ns.host}:{ns.port}")
            dealers.append(s)
        for _ in range(ns.raw):
            raws.append(socket.create_connection((ns.host, ns.port), timeout=10))
        print("open", flush=True)
        sys.stdin.readline()
    finally:
        for s in dealers:
            s.close(linger=0)
        for r in raws:
            r.close()
        ctx.term()
    print("closed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
