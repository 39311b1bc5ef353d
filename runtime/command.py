"""A satp command's process: the one the user started (a forked ``satp train`` runs for it:
:mod:`runtime.fork_server`), and what it sets first.
"""
from __future__ import annotations

import os

from runtime.fork_server import forked_for


def command_pid() -> int:
    """The pid of the process the user started for this command."""
    return forked_for() or os.getpid()


def set_command_environment() -> None:
    """What every satp command's process sets in its environment before anything imports a library."""
    os.environ.setdefault("OUTDATED_IGNORE", "1")  # ogb's PyPI version check
    from runtime.local_cluster import adopt_client_settings

    adopt_client_settings()  # Ray on loopback, the satp cluster's authentication: before anything imports Ray
