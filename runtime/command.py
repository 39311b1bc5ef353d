"""A satp command's process: the one the user started (a forked ``satp train`` runs for it:
:mod:`runtime.fork_server`), and what it sets first.
"""
from __future__ import annotations

import contextlib
import os
import sys

from runtime.fork_server import forked_for
from runtime.local_cluster import LOOPBACK_ENV, ClusterRecord


def warn(line: str) -> None:
    """One ``satp: warning:`` line on standard error."""
    print(f"satp: warning: {line}", file=sys.stderr, flush=True)


def command_pid() -> int:
    """The pid of the process the user started for this command."""
    return forked_for() or os.getpid()


def set_command_environment() -> None:
    """What every satp command's process sets before anything imports a library (Ray reads it when it
    loads): ogb's version check off, :data:`~runtime.local_cluster.LOOPBACK_ENV`, the satp cluster's
    authentication. A value the user set stays."""
    env = {"OUTDATED_IGNORE": "1", **LOOPBACK_ENV}
    with contextlib.suppress(ValueError):
        record = ClusterRecord.load()
        env.update(record.connect_env() if record is not None else {})
    for key, value in env.items():
        os.environ.setdefault(key, value)
