"""Where the file tier keeps a chunk, and how a directory is scanned after a restart.

    <fs_path>/kvwarden-v2/<scope>/<k0k1>/<k2k3>/<key>.kv

- ``kvwarden-v2``: the file format: `codec`'s header, zeros up to `PAYLOAD_AT` (4 KiB),
  then the bytes: a payload on a page boundary copies out of the page cache at full speed (one
  36 bytes in copied at half of it) and can be read with ``O_DIRECT``. A later format gets a
  directory of its own, so servers of two versions can share a mount.
- ``<scope>``: one directory per model configuration, the hex of the chunk scope
  (`dataplane.storage.keys.scope_digest`: model, world size, rank, dtype, layers, heads, head
  dim, format, block size: everything that makes a chunk's bytes valid). A model retired is
  one ``rm -r``; ``du`` shows what each holds.
- ``<k0k1>/<k2k3>``: two levels of 256 directories from the key's first bytes: with the keys
  uniform, 100 million chunks leave ~1,500 files a directory.
- A file is written under a temporary name no other writer can pick,
  ``.<key>.kv.<host>.<pid>.<random>.tmp``, in the same directory, then renamed over the final
  name (atomic on POSIX): readers see a whole file or none, whoever writes the key at once.

`scan` lists every chunk file (its scope, key, size and last use: the modification time, which
a read refreshes) and sweeps temporary files that no running writer owns: this host's whose
process is gone, and any older than `STALE_TMP_S` (another host's writer may still run).
"""

from __future__ import annotations

import os
import secrets
import socket
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

FORMAT_DIR = "kvwarden-v2"
PAYLOAD_AT = 4096  # where a file's payload starts (a page)
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
STALE_TMP_S = 600.0  # a temporary file this old is abandoned, whoever wrote it
KEY_HEX = 32  # a 16-byte chunk key
NO_SCOPE_DIR = "unscoped"
HOST = socket.gethostname().replace(".", "_")[:64] or "host"


def scope_dir(root: str, scope: bytes) -> str:
    return os.path.join(root, FORMAT_DIR, scope.hex() or NO_SCOPE_DIR)


def chunk_path(root: str, scope: bytes, key: bytes) -> str:
    h = key.hex()
    return os.path.join(scope_dir(root, scope), h[:2], h[2:4], h + SUFFIX)


def tmp_path(final: str) -> str:
    """A temporary name beside ``final`` that no other writer (thread, process, host) picks."""
    d, name = os.path.split(final)
    return os.path.join(d, f".{name}.{HOST}.{os.getpid()}.{secrets.token_hex(6)}{TMP_SUFFIX}")


def _tmp_owner(name: str) -> tuple[str, int] | None:
    """(host, pid) of a temporary file's writer, None when the name is not one of ours."""
    parts = name.split(".")
    # "", key, "kv", host, pid, random, "tmp"
    if len(parts) != 7 or parts[0] or parts[2] != SUFFIX[1:] or parts[6] != TMP_SUFFIX[1:]:
        return None
    try:
        return parts[3], int(parts[4])
    except ValueError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_tmp(name: str, mtime: float, now: float) -> bool:
    """Whether a temporary file is abandoned: this host's writer is gone, or it is too old."""
    owner = _tmp_owner(name)
    if owner is None:
        return False
    host, pid = owner
    if now - mtime > STALE_TMP_S:
        return True
    return host == HOST and pid != os.getpid() and not _alive(pid)


@dataclass(frozen=True, slots=True)
class ScannedFile:
    """A chunk file a scan found."""

    scope: bytes
    key: bytes
    size: int
    mtime: float


@dataclass
class ScanCounts:
    files: int = 0
    swept: int = 0  # stale temporary files removed
    errors: int = 0  # directories or files that could not be read


def scan(root: str, counts: ScanCounts, stop: Callable[[], bool] = lambda: False) -> Iterator[ScannedFile]:
    """Every chunk file under ``root`` (in directory order), sweeping stale temporary files on
    the way; unreadable parts are counted and skipped. Stops early when ``stop()``."""
    base = os.path.join(root, FORMAT_DIR)
    now = time.time()
    for scope_name in _names(base, counts):
        scope = _scope(scope_name)
        if scope is None:
            continue
        top = os.path.join(base, scope_name)
        for a in _names(top, counts):
            if stop():
                return
            for b in _names(os.path.join(top, a), counts):
                yield from _leaf(os.path.join(top, a, b), scope, now, counts)


def _scope(name: str) -> bytes | None:
    if name == NO_SCOPE_DIR:
        return b""
    try:
        return bytes.fromhex(name)
    except ValueError:
        return None


def _names(path: str, counts: ScanCounts) -> list[str]:
    try:
        with os.scandir(path) as it:
            return [e.name for e in it if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []
    except OSError:
        counts.errors += 1
        return []


def _leaf(path: str, scope: bytes, now: float, counts: ScanCounts) -> Iterator[ScannedFile]:
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return
    except OSError:
        counts.errors += 1
        return
    for e in entries:
        name = e.name
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue  # (removed meanwhile)
        if not stat.S_ISREG(st.st_mode):
            continue
        if name.endswith(TMP_SUFFIX):
            if stale_tmp(name, st.st_mtime, now):
                try:
                    os.unlink(e.path)
                    counts.swept += 1
                except OSError:
                    pass
            continue
        if len(name) != KEY_HEX + len(SUFFIX) or not name.endswith(SUFFIX):
            continue
        try:
            key = bytes.fromhex(name[:KEY_HEX])
        except ValueError:
            continue
        counts.files += 1
        yield ScannedFile(scope, key, st.st_size, st.st_mtime)
