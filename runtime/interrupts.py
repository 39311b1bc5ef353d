"""Ctrl-C and SIGTERM in satp's commands: an exception that unwinds, so the command can say what
it kept and shut Ray down, instead of dying where the signal landed.

Every place that starts or joins Ray calls :func:`install` after it (Ray installs exiting handlers);
clean-up runs under :func:`deferred`, where a signal waits for the end of the block.
"""
from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Any, Iterator, Optional


_first_signal: Optional[int] = None  # the command's first SIGINT / SIGTERM: its exit status (as_interrupted)
_deferring = 0  # > 0: inside deferred(), a signal waits (_pending) for the end of the block
_pending: Optional[int] = None  # a signal that arrived inside deferred()
_ending = False  # ending(): the command is ending; a handler installed again after it does not raise either


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; ``kept`` says what the interrupted command kept (one line)."""

    def __init__(self, signum: int = signal.SIGINT, kept: Optional[str] = None) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum, self.kept = int(signum), kept

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def install(keep: Any = None) -> None:
    """Raise :class:`Interrupted` on SIGINT and SIGTERM in the main thread from now on (elsewhere
    nothing changes). ``keep`` stays referenced while these handlers are installed: Ray Train's
    controller actor, which its last handle going with the unwound frames would kill at once."""
    if threading.current_thread() is not threading.main_thread():
        return

    def _raise(signum, frame, _keep=keep):
        global _first_signal, _pending
        if _first_signal is None:
            _first_signal = signum
        if _ending:
            return
        if _deferring:
            _pending = signum if _pending is None else _pending
            return
        if "ray" in sys.modules:  # after an interrupt the cluster's forwarded logs are its actors going down
            from runtime.ray_private import stop_printing_cluster_logs

            stop_printing_cluster_logs()
        raise Interrupted(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _raise)
    if sys.unraisablehook is not _arrive_again:
        global _unraisablehook
        _unraisablehook, sys.unraisablehook = sys.unraisablehook, _arrive_again


_unraisablehook = sys.unraisablehook  # the hook _arrive_again passes everything else on to


def _arrive_again(unraisable: Any) -> None:
    """An :class:`Interrupted` that a finalizer dropped (the message empty): its signal is sent to the
    main thread again after a moment, from a thread (a handler run from here would still be inside
    the finalizer). Anything else goes on to the previous hook."""
    if isinstance(unraisable.exc_value, Interrupted) and unraisable.err_msg is None:
        again = threading.Timer(_ARRIVE_AGAIN_S, signal.pthread_kill,
                                (threading.main_thread().ident, unraisable.exc_value.signum))
        again.daemon = True
        again.start()
        return
    _unraisablehook(unraisable)


_ARRIVE_AGAIN_S = 0.05


def reset() -> None:
    """A new command in this process: no signal seen, none deferred (see the module docstring)."""
    global _first_signal, _deferring, _pending, _ending
    _first_signal, _deferring, _pending, _ending = None, 0, None, False


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """SIGINT and SIGTERM wait while the block runs (a clean-up a signal must not cut short): one that
    arrived meanwhile is raised when the outermost block ends, unless the command is :func:`ending`."""
    global _deferring, _pending
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
        if not _deferring and _pending is not None and not _ending:
            signum, _pending = _pending, None
            raise Interrupted(signum)


def ending() -> None:
    """The command caught its interrupt and only ends now: SIGINT and SIGTERM are ignored until the
    process exits (ignored, not handled: the interpreter restores the default action in place of a
    Python handler while it finalises)."""
    global _ending
    _ending = True
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)


def as_interrupted(exc: KeyboardInterrupt) -> Interrupted:
    """``exc`` as an :class:`Interrupted` of the command's first signal (SIGINT when no handler saw
    one: ``ray.get`` turns a handler's exception into a plain ``KeyboardInterrupt``), keeping ``kept``."""
    signum = _first_signal if _first_signal is not None else getattr(exc, "signum", signal.SIGINT)
    return Interrupted(signum, kept=getattr(exc, "kept", None))
