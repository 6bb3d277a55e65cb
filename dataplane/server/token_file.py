"""Reading a secret from a file: the admin token (`Settings.admin_token_file`)."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def read_token_file(path: Path) -> str:
    """The first line of ``path``, stripped. ValueError (naming the rule) unless the file is a
    regular file that neither group nor other may access (mode & 0o077 == 0) and that line is
    not empty. The checks are made on the opened file, so a swapped path cannot slip through."""
    where = f"{path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO cannot block
    except OSError as exc:
        raise ValueError(f"{where}: cannot open it ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{where}: must be a regular file")
        if st.st_mode & 0o077:
            raise ValueError(
                f"{where}: mode {stat.S_IMODE(st.st_mode):04o} lets group or other users access it; "
                "it must be readable by its owner only (chmod 600)"
            )
        head = os.read(fd, 4096)
    finally:
        os.close(fd)
    first = head.split(b"\n", 1)[0].decode("utf-8", "surrogateescape").strip()
    if not first:
        raise ValueError(f"{where}: the first line (the token) is empty")
    return first
