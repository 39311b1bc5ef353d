"""One writer at a time for a dataset's columnar store or a shard directory: an exclusive ``flock``
on a lock file beside it (released by the kernel when its holder ends, killed included; on NFS a
POSIX lock the server arbitrates); a second writer says whom it waits for and waits. Lock files stay."""
from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sys
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def writer_lock(path: Path, what: str) -> Iterator[None]:
    """Hold the exclusive lock ``path`` while writing ``what`` (named in the line a waiting writer prints)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            print(f"satp: {what} is being written by {holder}: waiting for it to finish", file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        # who holds it, for the line of a waiting writer (a full disk may refuse it: the lock holds anyway)
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"satp (pid {os.getpid()} on {socket.gethostname()})\n".encode(), 0)
        yield
    finally:
        os.close(fd)
