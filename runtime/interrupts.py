"""Ctrl-C and SIGTERM in satp's commands: an exception that unwinds, so the command can say what
it kept and shut Ray down, instead of dying where the signal landed.

``ray.init`` installs its own SIGTERM handling in the driver: a Python handler that exits, and
the C++ core worker's failure-signal handler, which prints a stack dump first. Ray Train's
``fit`` installs a SIGINT handler that aborts the run and then exits with status 0. So every
place that starts or joins Ray calls :func:`install` after it, which puts :func:`_raise` back on
both signals.

The CLI turns :class:`Interrupted` (or a plain ``KeyboardInterrupt``) into one line and the
conventional status: 130 for SIGINT, 143 for SIGTERM.
"""
from __future__ import annotations

import signal
import sys
import threading
from typing import Any, Optional


_last_signal: int = signal.SIGINT  # the signal :func:`install`'s handler last raised for (see as_interrupted)


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
    (its clean-up actor's tracebacks). The CLI shuts Ray down first, then installs anew.
    Elsewhere (a Tune trial's thread) nothing changes: only the main thread may set handlers."""
    if threading.current_thread() is not threading.main_thread():
        return

    def _raise(signum, frame, _keep=keep):
        global _last_signal
        _last_signal = signum
        _stop_printing_cluster_logs()
        raise Interrupted(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _raise)


def _stop_printing_cluster_logs() -> None:
    """Stop printing the Ray cluster's forwarded logs in this driver: after an interrupt they are
    its actors going down (Ray Train's placement-group cleaner logs a traceback when the controller
    is gone), which tells the user nothing. ``ray.shutdown`` removes the same handler."""
    if "ray" not in sys.modules:
        return
    try:
        from ray._private.worker import global_worker_stdstream_dispatcher

        global_worker_stdstream_dispatcher.remove_handler("ray_print_logs")
    except (ImportError, AttributeError, KeyError):
        pass


def as_interrupted(exc: KeyboardInterrupt) -> Interrupted:
    """``exc`` as an :class:`Interrupted`. Ray's ``ray.get`` turns the exception a signal handler
    raised into a plain ``KeyboardInterrupt``: the signal is the one the handler saw last (SIGINT
    when none did)."""
    return exc if isinstance(exc, Interrupted) else Interrupted(_last_signal)
