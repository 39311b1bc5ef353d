"""What the ``satp`` command writes to the terminal, and what it writes to files.

A log redirected to a file (``satp train job.yaml 2> train.log``, a CI job, a Ray job's log)
should read like a log: no ANSI colour codes (Ray colours its worker prefixes and its dashboard
URL) and no progress bars redrawn with carriage returns (tqdm bars from OGB, MLflow, the
preprocessing stage). :func:`setup` decides once, at the start of the command, before Ray or
tqdm are imported (Ray's log handler keeps the stream it finds at import):

* standard error not a terminal: colour codes are stripped from ``sys.stdout`` and
  ``sys.stderr``, Ray is told not to colour (``RAY_COLOR_PREFIX=0``, inherited by the Ray
  processes this command starts), and tqdm bars are off (``TQDM_DISABLE=1``: tqdm >= 4.66 reads
  its defaults from ``TQDM_*`` variables, which reaches bars in libraries such as OGB);
* ``--no-progress``: the bars are off on a terminal too.

A variable the user set already is left as it is.
"""
from __future__ import annotations

import io
import os
import re
import sys

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class StripAnsi(io.TextIOBase):
    """A text stream that forwards to ``stream`` without ANSI escape sequences."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(_ANSI.sub("", text))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self):  # noqa: D401 - mirrors the wrapped stream
        return getattr(self._stream, "encoding", "utf-8")

    @property
    def errors(self):
        return getattr(self._stream, "errors", "strict")

    def writable(self) -> bool:
        return True

    def __getattr__(self, name: str):  # anything else (buffer, mode, name, ...) is the stream's
        return getattr(self._stream, name)


def is_terminal(stream=None) -> bool:
    stream = stream or sys.stderr
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def setup(progress: bool = True) -> None:
    """Configure colour and progress output for this command (see the module docstring)."""
    terminal = is_terminal(sys.stderr)
    if not terminal:
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            if stream is not None and not isinstance(stream, StripAnsi) and not is_terminal(stream):
                setattr(sys, name, StripAnsi(stream))
    if not terminal or not progress:
        os.environ.setdefault("TQDM_DISABLE", "1")


def show_progress() -> bool:
    """Whether progress bars are wanted (a terminal, and no ``--no-progress``)."""
    return os.environ.get("TQDM_DISABLE", "") in ("", "0", "false", "False") and is_terminal(sys.stderr)


def plural(count: int, noun: str) -> str:
    """``1 epoch``, ``2 epochs``: counts in messages."""
    return f"{count} {noun}{'' if count == 1 else 's'}"
