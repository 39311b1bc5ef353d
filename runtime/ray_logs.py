"""Ray Train's console noise kept off the console, in the worker processes of satp's clusters.

:func:`quiet_ray_train_noise` (the job's ``worker_process_setup_hook``, and run by a process that
imports this module ahead) lowers Ray Train's "safe to ignore" ``GetTimeoutError`` tracebacks to
DEBUG, drops the placement-group cleaner's every-second warning, and marks satp's own log records in
an actor with :data:`MARK`. :class:`RetryNotice` says in one line what a worker-group restart lost.
"""
from __future__ import annotations

import logging
import sys
from pathlib import PurePosixPath
from typing import Any, Optional

import ray
from ray.train import UserCallback

from runtime.fork_server import SATP_PACKAGES

#: what starts the lines of satp's own code in Ray's processes (``satp: warning: ...`` as printed,
#: ``satp: epoch 0: ...`` for a log record of satp's packages)
MARK = "satp: "

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
    """Drop the cleaner's "Failed to query Ray Train Controller actor state" warning (lowered to DEBUG,
    Ray's console handler of the cleaner's actor, which has no level, would still print it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.WARNING and record.getMessage().startswith(
            "Failed to query Ray Train Controller actor state"))


def quiet_ray_train_noise() -> None:
    """Install both filters and the mark of satp's records (see the module docstring); a second call
    adds nothing."""
    for name, kind in [*((n, TransientTimeouts) for n in COORDINATOR_LOGGERS), (CLEANER_LOGGER, UnansweredStateQueries)]:
        logger = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in logger.filters):
            logger.addFilter(kind())
    mark_satp_records()


def mark_satp_records() -> None:
    """Make the log records of :data:`SATP_PACKAGES` start with :data:`MARK` in an actor's process,
    through the record factory (Ray Train sets a worker's handlers itself)."""
    made = logging.getLogRecordFactory()
    if getattr(made, "marks_satp_records", False):
        return

    def marked(*args, **kwargs) -> logging.LogRecord:
        record = made(*args, **kwargs)
        if (record.name.split(".")[0] in SATP_PACKAGES and isinstance(record.msg, str)
                and not record.msg.startswith(MARK) and ray.is_initialized()
                and ray.get_runtime_context().get_actor_id() is not None):
            record.msg = MARK + record.msg
        return record

    marked.marks_satp_records = True
    logging.setLogRecordFactory(marked)


class RetryNotice(UserCallback):
    """Ray Train's controller says, in one line, each failure the run goes on after: what was lost, the
    global step of the newest checkpoint reported (``step_key`` in its metrics) the new worker group
    resumes from, and the retry ``k of max_failures`` (the job's ``setting``); ``report``: where the
    command keeps Ray's own report of it."""

    step_key = "global_step"

    def __init__(self, max_failures: int, setting: str, report: str) -> None:
        self.max_failures, self.setting, self.report = max_failures, setting, report
        self.step, self.checkpoint, self.failures = None, None, 0

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint: Optional[Any]) -> None:
        if checkpoint is not None and metrics and self.step_key in metrics[0]:
            self.step, self.checkpoint = int(metrics[0][self.step_key]), PurePosixPath(checkpoint.path).name

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        self.failures += 1
        if self.failures > self.max_failures:
            return
        where = (f"from global step {self.step} (checkpoint {self.checkpoint})" if self.checkpoint else
                 "from where this command started it (no checkpoint since)")
        print(f"{MARK}warning: {lost(worker_exceptions)}: the run went on {where}; "
              f"retry {self.failures} of {self.max_failures} ({self.setting}); Ray's report: {self.report}",
              file=sys.stderr, flush=True)


def lost(worker_exceptions: dict[int, Exception]) -> str:
    """What failed, from Ray Train's errors by rank: a training function's exception arrives as a
    ``UserExceptionWithTraceback``, a dead worker or node as anything else (then it is the cause)."""
    raised = {rank: error for rank, error in worker_exceptions.items()
              if type(error).__name__ == "UserExceptionWithTraceback"}
    gone = sorted(set(worker_exceptions) - set(raised))
    if gone:
        return f"a worker or its node was lost (rank {', '.join(map(str, gone))})"
    rank = min(raised)
    last = (str(raised[rank]).strip().splitlines() or ["an exception"])[-1]
    return f"a worker failed (rank {rank}: {last.split(':')[0]})"


quiet_ray_train_noise()  # what a worker process that imports this module ahead runs (see the module docstring)
