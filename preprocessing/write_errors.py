"""One-line errors of a failed write of the data path: the file, the reason, what is kept and, for a
full disk, what to do. Arrow's errors name no file: :func:`os_reason` reads their errno."""
from __future__ import annotations

import errno
import os
import re

FULL = (errno.ENOSPC, errno.EDQUOT)  # the disk, or the user's quota, is full


def _arrow_errno(exc: OSError) -> int | None:
    found = re.search(r"\[errno (\d+)\]", str(exc), re.IGNORECASE)
    return int(found.group(1)) if found else None


def error_number(exc: OSError) -> int | None:
    """The error number of ``exc``; pyarrow's file systems may carry it in the message only."""
    return _arrow_errno(exc) or exc.errno


def os_reason(exc: OSError) -> str:
    """``No space left on device`` of an OSError, also of pyarrow's (``Error writing bytes to file.
    Detail: [errno 28] ...``, without ``errno`` set)."""
    number = _arrow_errno(exc)
    if number is not None:
        return os.strerror(number)
    return exc.strerror or (str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


def write_error(path, exc: OSError, kept: str) -> OSError:
    """The one-line ``OSError`` of a write of ``path`` that failed with ``exc`` (``kept``: what stays,
    e.g. ``the shards finished before it are kept``), with its errno."""
    number = error_number(exc)
    if number in FULL:
        error = OSError(f"{path}: could not write it ({os.strerror(number)}); {kept}: free space there and run the "
                        "same command again")
    else:
        error = OSError(f"{path}: could not write it ({os_reason(exc)}); {kept}")
    error.errno = number
    return error
