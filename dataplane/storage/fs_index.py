"""What the file tier knows is on disk: key -> (scope, size) in least-recently-used order, and
the bytes it adds up to (`dataplane.storage.fs_tier` keeps one; its own lock, a leaf)."""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dataplane.storage.fs_layout import Found


@dataclass
class FileEntry:
    scope: bytes
    size: int  # the file's bytes (header included)


class FileIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # leaf: guards _files and _used
        self._files: collections.OrderedDict[bytes, FileEntry] = collections.OrderedDict()
        self._used = 0

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._files

    def sizes(self) -> tuple[int, int]:
        """(files, bytes)."""
        with self._lock:
            return len(self._files), self._used

    def prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are known."""
        n = 0
        with self._lock:
            for k in keys:
                if k not in self._files:
                    break
                n += 1
        return n

    def learn(self, scope: bytes, key: bytes, size: int) -> None:
        """``key`` is on disk and was used now."""
        with self._lock:
            if key in self._files:
                self._files.move_to_end(key)
                return
            self._files[key] = FileEntry(scope, size)
            self._used += size

    def forget(self, key: bytes) -> None:
        with self._lock:
            f = self._files.pop(key, None)
            if f is not None:
                self._used -= f.size

    def victims(self, room: int, capacity: int) -> list[tuple[bytes, FileEntry]]:
        """Take the least recently used entries out until ``room`` more bytes fit in ``capacity``."""
        out: list[tuple[bytes, FileEntry]] = []
        with self._lock:
            while self._files and self._used + room > capacity:
                key, f = self._files.popitem(last=False)
                self._used -= f.size
                out.append((key, f))
        return out

    def merge(self, found: Iterable[Found]) -> None:
        """Match a scan: forget what it did not find, learn what it found that is not known (at
        the old end, the most recently modified last: their use here is unknown)."""
        found = sorted(found, key=lambda f: f.mtime, reverse=True)
        seen = {f.key for f in found}
        with self._lock:
            for gone in [k for k in self._files if k not in seen]:
                self._used -= self._files.pop(gone).size
            for f in found:  # newest first, each to the old end: the oldest ends up first
                if f.key not in self._files:
                    self._files[f.key] = FileEntry(f.scope, f.size)
                    self._files.move_to_end(f.key, last=False)
                    self._used += f.size
