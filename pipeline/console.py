"""What the ``satp`` command writes to the terminal, and what it writes to files.

:func:`setup` decides once, before Ray or tqdm are imported (Ray's log handler keeps the stream it
finds): without a terminal, no colour codes and no progress bars (``--no-progress``: none on a
terminal either); a variable the user set already is left as it is. ``satp train`` keeps Ray's own
output in the run's log file, the terminal showing only satp's own lines (:func:`divert_ray_output`).
"""
from __future__ import annotations

import io
import os
import re
import sys
import threading
from pathlib import Path

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class _Wrapper(io.TextIOBase):
    """A text stream that forwards to ``stream``; subclasses filter :meth:`write`."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def flush(self) -> None:
        self._stream.flush()

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


class StripAnsi(_Wrapper):
    """A text stream that forwards to ``stream`` without ANSI escape sequences."""

    def write(self, text: str) -> int:
        self._stream.write(_ANSI.sub("", text))
        return len(text)

    def isatty(self) -> bool:
        return False


#: the prefix of a line Ray forwards from one of its processes: ``(RayTrainWorker pid=12)``,
#: ``(pid=12, ip=10.0.0.2)``, ``(raylet)``, ``(autoscaler +1s)``
_RAY_PREFIX = re.compile(r"\((?:raylet|autoscaler[^)]*|[^()]*pid=[^()]*)\)(?: |$)")
#: what starts satp's own lines (``runtime.ray_logs.MARK``, spelt here: that module imports Ray Train)
MARK = "satp: "


class RayReport:
    """The file that receives Ray's lines, created with the first of them; shared by the streams."""

    def __init__(self, path: Path) -> None:
        self.path, self._file, self._lock = Path(path), None, threading.Lock()

    def write(self, line: str) -> None:
        with self._lock:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = self.path.open("a", encoding="utf-8")
            self._file.write(line)
            self._file.flush()


class WithoutRayLines(_Wrapper):
    """A text stream that forwards to ``stream`` all but Ray's forwarded lines, which go to ``report``;
    of those, satp's own (``(Name pid=N) satp: ...``) are shown too: a ``satp: warning`` or
    ``satp: error`` line as it is, any other with Ray's prefix and without the mark. A line is held
    until it is whole only when it starts as Ray's do, and per thread: Ray's threads print a line's
    text and its newline in two writes, between which another thread may write."""

    def __init__(self, stream, report: RayReport) -> None:
        super().__init__(stream)
        self._report, self._local = report, threading.local()

    def write(self, text: str) -> int:
        local = self._local
        for piece in text.splitlines(keepends=True):
            held, passing = getattr(local, "held", None), getattr(local, "passing", False)
            if held is None and not passing and _ANSI.sub("", piece).startswith("("):
                held = ""
            if held is None:
                self._stream.write(piece)
                local.passing = not piece.endswith("\n")
                continue
            held += piece
            local.held = None if held.endswith("\n") else held
            if local.held is None:
                self._route(held)
        return len(text)

    def _route(self, line: str) -> None:
        plain = _ANSI.sub("", line)
        prefix = _RAY_PREFIX.match(plain)
        if prefix is None:
            self._stream.write(line)
            return
        self._report.write(plain)
        message = plain[prefix.end():]
        if message.startswith((f"{MARK}warning", f"{MARK}error")):
            self._stream.write(message)
        elif message.startswith(MARK):
            self._stream.write(line.replace(f" {MARK}", " ", 1))

    def isatty(self) -> bool:
        return is_terminal(self._stream)


def divert_ray_output(path: Path) -> Path:
    """Send the lines Ray forwards to this process to the file ``path`` (created with the first of
    them), showing satp's own (:class:`WithoutRayLines`), on standard output and error; return ``path``."""
    report = RayReport(path)
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, WithoutRayLines):
            setattr(sys, name, WithoutRayLines(stream, report))
    return report.path


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
