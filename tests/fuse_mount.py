"""A real FUSE mount whose server can be frozen: a mount that stops answering.

`FuseMount` runs this file as a process: a pass-through file system (fusepy over libfuse2)
exposing ``backing`` at ``mountpoint``. SIGSTOP its process and every call into the mount blocks
in the kernel, exactly as on a network mount whose server is gone; SIGCONT and they go on.
Mounting needs root and /dev/fuse; `FuseMount` says why when it cannot (the caller fails).

    python tests/fuse_mount.py BACKING MOUNTPOINT
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any


def _serve(backing: str, mountpoint: str) -> None:
    from fuse import FUSE, FuseOSError, Operations  # type: ignore[import-untyped]

    class Loopback(Operations):  # type: ignore[misc]
        def __init__(self, root: str) -> None:
            self.root = os.path.realpath(root)

        def _p(self, path: str) -> str:
            return os.path.join(self.root, path.lstrip("/"))

        def __call__(self, op: str, path: str, *args: Any) -> Any:
            try:
                return super().__call__(op, self._p(path) if path is not None else path, *args)
            except OSError as exc:
                raise FuseOSError(exc.errno or errno.EIO) from None

        def access(self, path: str, mode: int) -> None:
            if not os.access(path, mode):
                raise FuseOSError(errno.EACCES)

        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            st = os.lstat(path)
            keys = ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime", "st_nlink", "st_size", "st_uid")
            return {k: getattr(st, k) for k in keys}

        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", *os.listdir(path)]

        def mkdir(self, path: str, mode: int) -> None:
            os.mkdir(path, mode)

        def rmdir(self, path: str) -> None:
            os.rmdir(path)

        def unlink(self, path: str) -> None:
            os.unlink(path)

        def rename(self, old: str, new: str) -> None:
            os.rename(old, self._p(new))

        def utimens(self, path: str, times: tuple[float, float] | None = None) -> None:
            os.utime(path, times)

        def statfs(self, path: str) -> dict[str, Any]:
            sv = os.statvfs(path)
            keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag")
            return {k: getattr(sv, k) for k in (*keys, "f_frsize", "f_namemax")}

        def open(self, path: str, flags: int) -> int:
            return os.open(path, flags)

        def create(self, path: str, mode: int, fi: Any = None) -> int:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            return os.pread(fh, size, offset)

        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            return os.pwrite(fh, data, offset)

        def truncate(self, path: str, length: int, fh: int | None = None) -> None:
            os.truncate(path, length)

        def flush(self, path: str, fh: int) -> None:
            return None

        def release(self, path: str, fh: int) -> None:
            os.close(fh)

        def fsync(self, path: str, datasync: bool, fh: int) -> None:
            os.fsync(fh)

    FUSE(Loopback(backing), mountpoint, foreground=True, nothreads=False, allow_other=True)


class FuseMount:
    """The pass-through mount of ``backing`` at ``mountpoint``, served by a process of its own."""

    def __init__(self, backing: Path, mountpoint: Path) -> None:
        if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
            raise RuntimeError("a FUSE mount needs root and /dev/fuse (make test installs libfuse2)")
        backing.mkdir(parents=True, exist_ok=True)
        mountpoint.mkdir(parents=True, exist_ok=True)
        self.mountpoint = mountpoint
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(backing), str(mountpoint)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        from tests.helpers import wait_until  # (here: this file also runs as a script, outside the package)

        with contextlib.suppress(AssertionError):  # (not up in time: said below, with its output)
            wait_until(lambda: os.path.ismount(mountpoint) or self.proc.poll() is not None, 20)
        if not os.path.ismount(mountpoint):
            err = b"" if self.proc.stderr is None else self.proc.stderr.read()
            self.close()
            raise RuntimeError(f"the FUSE mount did not come up: {err.decode(errors='replace')}")

    def freeze(self) -> None:
        """Stop the file system's process: from when this returns, every call into the mount
        blocks in the kernel (a SIGSTOP lands asynchronously, thread by thread: waited for)."""
        from tests.helpers import wait_until

        self.proc.send_signal(signal.SIGSTOP)
        wait_until(self._stopped, 10, 0.001, what="the file system's process stopped")

    def _stopped(self) -> bool:
        tasks = Path(f"/proc/{self.proc.pid}/task")
        return all(_state(t / "stat") in ("T", "t") for t in tasks.iterdir())

    def thaw(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGCONT)
        umount = shutil.which("fusermount") or "umount"
        subprocess.run([umount, "-u" if "fusermount" in umount else "-l", str(self.mountpoint)], timeout=30)
        if os.path.ismount(self.mountpoint):
            subprocess.run(["umount", "-l", str(self.mountpoint)], timeout=30)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


def _state(stat: Path) -> str:
    """A thread's state letter in its ``/proc/.../stat`` ("T": stopped); "" once it is gone."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2])
