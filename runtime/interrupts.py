"""Ctrl-C and SIGTERM in satp's commands: an exception that unwinds, so the command can say what
it kept and shut Ray down, instead of dying where the signal landed.

``ray.init`` installs its own SIGTERM handling in the driver: a Python handler that exits (and
the C++ core worker's failure-signal handler, which satp turns off in its drivers:
:func:`runtime.ray_private.disable_failure_signal_handler`). Ray Train's ``fit`` installs a
SIGINT handler that aborts the run and then exits with status 0. So every place that starts or joins Ray calls
:func:`install` after it, which puts :func:`_raise` back on both signals.

The CLI turns :class:`Interrupted` (or a plain ``KeyboardInterrupt``) into one line and the
conventional status: 130 for SIGINT, 143 for SIGTERM.

More signals while the first is handled (Ctrl-C pressed again, a terminal's Ctrl-C reaching every
process of the command's group, a scheduler's SIGTERM after its SIGINT) must not cut the clean-up
short: the last line, Ray's shutdown (which stops the local cluster's processes) and the removal
of the cluster's private temporary folder at exit. So clean-up on the way out runs under
:func:`deferred`, where a signal waits for the end of the block, and once the command has caught
its interrupt it calls :func:`ending`: from then until the process exits, signals are ignored.
The status is the first signal's (:func:`as_interrupted`). A command that must end at once takes
SIGKILL, or Ctrl-\\ (SIGQUIT).

Python runs a signal's handler between any two bytecodes, also inside a finalizer (a weakref's
callback, a ``__del__``, which Ray's and torch's objects have many of), where an exception is
printed as "Exception ignored" and dropped: the interrupt would be lost and the command run on.
:func:`install` also hooks :data:`sys.unraisablehook` so that such a dropped :class:`Interrupted`
arrives again, once the finalizer has returned.
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
    """Raise :class:`Interrupted` on SIGINT and SIGTERM in the main thread from now on.

    ``keep`` stays referenced as long as these handlers are installed: Ray Train's controller
    actor, whose last handle would otherwise go with the frames the exception unwinds, and an
    actor without handles is killed at once, while the driver still prints the cluster's logs
    (its clean-up actor's tracebacks). The CLI drops it when the command ends (:func:`ending`).
    Elsewhere (a Tune trial's thread) nothing changes: only the main thread may set handlers."""
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
        _stop_printing_cluster_logs()
        raise Interrupted(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _raise)
    if sys.unraisablehook is not _arrive_again:
        global _unraisablehook
        _unraisablehook, sys.unraisablehook = sys.unraisablehook, _arrive_again


_unraisablehook = sys.unraisablehook  # the hook _arrive_again passes everything else on to


def _arrive_again(unraisable: Any) -> None:
    """An :class:`Interrupted` that a finalizer dropped (Python passes it here, the message empty):
    its signal is sent to the main thread again after a moment, from a thread (a handler run from
    here would still be inside the finalizer, and dropped again; one still running by then drops
    it once more, and so on); a wait in the main thread ends, and the handler installed for the
    signal runs, as the first time. Anything else, and what an exit handler dropped (the command
    is ending), goes on as before."""
    if isinstance(unraisable.exc_value, Interrupted) and unraisable.err_msg is None:
        again = threading.Timer(_ARRIVE_AGAIN_S, signal.pthread_kill,
                                (threading.main_thread().ident, unraisable.exc_value.signum))
        again.daemon = True
        again.start()
        return
    _unraisablehook(unraisable)


_ARRIVE_AGAIN_S = 0.05


def _stop_printing_cluster_logs() -> None:
    """Stop printing the Ray cluster's forwarded logs in this driver: after an interrupt they are
    its actors going down (Ray Train's placement-group cleaner logs a traceback when the controller
    is gone), which tells the user nothing (:func:`runtime.ray_private.stop_printing_cluster_logs`)."""
    if "ray" in sys.modules:
        from runtime.ray_private import stop_printing_cluster_logs

        stop_printing_cluster_logs()


def reset() -> None:
    """A new command in this process: no signal seen, none deferred (see the module docstring)."""
    global _first_signal, _deferring, _pending, _ending
    _first_signal, _deferring, _pending, _ending = None, 0, None, False


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """SIGINT and SIGTERM wait while the block runs, a clean-up that a signal must not cut short
    (closing the MLflow run, releasing the run's lease): one that arrived meanwhile is raised when
    the block ends (the outermost one; not once the command is :func:`ending`). Main thread only:
    signals are handled there."""
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
    """The command caught its interrupt and only ends now: from here until the process exits,
    SIGINT and SIGTERM are ignored (what Ray and satp clean up at exit runs whole, and the status
    stays the first signal's). Ignored, not handled: the interpreter puts the default action (to
    die of the signal) back in place of a Python handler while it finalises, after the clean-up at
    exit; it leaves "ignore" as it is. This also drops what :func:`install` kept alive for the
    training."""
    global _ending
    _ending = True
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)


def as_interrupted(exc: KeyboardInterrupt) -> Interrupted:
    """``exc`` as an :class:`Interrupted` of the command's first signal (the exit status says what
    stopped it, not what arrived while it stopped; SIGINT when no handler saw one: ``ray.get`` turns
    the exception a signal handler raised into a plain ``KeyboardInterrupt``), keeping what it kept."""
    signum = _first_signal if _first_signal is not None else getattr(exc, "signum", signal.SIGINT)
    return Interrupted(signum, kept=getattr(exc, "kept", None))
