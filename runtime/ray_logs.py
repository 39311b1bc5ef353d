"""Ray's "safe to ignore" timeouts kept off the console, in the processes of satp's Ray jobs.

Ray Train V2's controller asks Ray's autoscaling coordinator (a detached actor, started by the first
Train run of a cluster) for the workers' resources when it starts and every 20 s, waiting 5 s for
the answer (``ray/train/v2/_internal/execution/scaling_policy/autoscaling_coordinator_client.py``,
and ``elastic.py`` for elastic runs). On a busy machine the answer can take longer, mostly while the
actor itself starts (its process and imports); the controller then logs a warning with the whole
``GetTimeoutError`` traceback, which says itself that it is safe to ignore when it is transient, and
the driver prints it among a run that succeeds. Nothing depends on the answer on a fixed-size
cluster: the request only tells an autoscaler what to add.

:func:`quiet_transient_timeouts` is the job's ``worker_process_setup_hook`` (Ray runs it in every
worker process of the job, the Train controller included): those warnings, and only when their
exception is a ``GetTimeoutError``, go down to DEBUG, below Ray Train's console level (INFO): they
stay in Ray Train's own log files (``logs/train/ray-train-sys-controller-*.log``), the console no
longer shows them; the same warnings with any other error keep their level.
"""
from __future__ import annotations

import logging

#: Ray Train's loggers that log a timed-out request to the autoscaling coordinator as "safe to ignore".
COORDINATOR_LOGGERS = (
    "ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client",
    "ray.train.v2._internal.execution.scaling_policy.elastic",
)


class TransientTimeouts(logging.Filter):
    """Lower a WARNING whose exception is Ray's ``GetTimeoutError`` to DEBUG; pass everything else."""

    def filter(self, record: logging.LogRecord) -> bool:
        from ray.exceptions import GetTimeoutError

        error = record.exc_info[0] if record.exc_info else None
        if record.levelno == logging.WARNING and isinstance(error, type) and issubclass(error, GetTimeoutError):
            record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return True


def quiet_transient_timeouts() -> None:
    """The ``worker_process_setup_hook`` of satp's Ray jobs (see the module docstring)."""
    for name in COORDINATOR_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, TransientTimeouts) for f in logger.filters):
            logger.addFilter(TransientTimeouts())
