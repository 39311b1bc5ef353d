"""Ray Train's console noise kept off the console, in the worker processes of satp's clusters.

Two warnings that Ray Train logs over and over while a run goes well:

* Ray Train V2's controller asks Ray's autoscaling coordinator (a detached actor, started by the
  first Train run of a cluster) for the workers' resources when it starts and every 20 s, waiting
  5 s for the answer (``ray/train/v2/_internal/execution/scaling_policy/autoscaling_coordinator_client.py``,
  and ``elastic.py`` for elastic runs). On a busy machine the answer can take longer, mostly while
  the actor itself starts; the controller then logs a warning with the whole ``GetTimeoutError``
  traceback, which says itself that it is safe to ignore when it is transient. Nothing depends on
  the answer on a fixed-size cluster: the request only tells an autoscaler what to add.
* Ray Train's placement-group cleaner (of a Ray Train run other than satp's, which start none)
  asks the State API (the dashboard) every second whether the run's controller lives, and on a
  cluster without a dashboard logs "Failed to query Ray Train Controller actor state" every second
  of the run. (What it would clean up after an interrupted run, satp's worker pool ends:
  :meth:`runtime.worker_pool.WorkerPool.end_orphaned_cleaners`.)

:func:`quiet_ray_train_noise` lowers the timeout warning to DEBUG, below Ray Train's console level
(INFO), when its exception is a ``GetTimeoutError`` (the same warning about any other error keeps
its level): it stays in Ray Train's own log files (``logs/train/ray-train-sys-controller-*.log``).
The cleaner's warning is dropped: its process has no such files. It runs where Ray Train logs
them, in the cluster's worker processes: importing this module runs it, and the raylet of every cluster satp starts imports this module in
each worker it starts (``RAY_preload_python_modules``: :mod:`runtime.worker_pool`); on a cluster
satp did not start, it is the job's ``worker_process_setup_hook`` (:mod:`runtime.ray_cluster`).
It holds no training code: a warm process that imported it runs no stale satp code.
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


#: Ray Train's placement-group cleaner, which logs a failed State API query every second without a dashboard
CLEANER_LOGGER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"


class UnansweredStateQueries(logging.Filter):
    """Drop the cleaner's "Failed to query Ray Train Controller actor state" warning. The cleaner is
    an actor of its own, whose records reach only Ray's default console handler, which has no level:
    a record lowered to DEBUG would still be printed, every second of the run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.WARNING and record.getMessage().startswith(
            "Failed to query Ray Train Controller actor state"))


def quiet_ray_train_noise() -> None:
    """Install both filters (see the module docstring); a second call adds nothing."""
    for name, kind in [*((n, TransientTimeouts) for n in COORDINATOR_LOGGERS), (CLEANER_LOGGER, UnansweredStateQueries)]:
        logger = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in logger.filters):
            logger.addFilter(kind())


quiet_ray_train_noise()  # what a worker process that imports this module ahead runs (see the module docstring)
