"""A satp command's process: the one the user started (or runs it for), and what it sets first.

A ``satp train`` on a satp cluster with a warm driver (:mod:`pipeline.cli.warm_driver`) is run by
a process forked from that driver, while the process the user started (the one their terminal,
``ps`` and ``kill`` see) waits for it and forwards its signals. What names or times the command,
a run's lease (its holder) and its start-up (counted from the command's start), means that one.
"""
from __future__ import annotations

import os

#: set in a process forked by the warm driver: the pid of the command's own process
COMMAND_PID_VAR = "SATP_COMMAND_PID"


def command_pid() -> int:
    """The pid of the process the user started for this command."""
    return int(os.environ.get(COMMAND_PID_VAR) or os.getpid())


def forked_for_a_command() -> bool:
    """Whether this process runs a command for another process (the warm driver's fork)."""
    return bool(os.environ.get(COMMAND_PID_VAR))


def set_command_environment() -> None:
    """What every satp command's process sets in its environment before anything imports a library
    (the warm driver too: what a command forked from it finds imported was imported with these)."""
    os.environ.setdefault("OUTDATED_IGNORE", "1")  # ogb's PyPI version check
    from runtime.local_cluster import adopt_client_settings

    adopt_client_settings()  # the satp cluster's authentication, before anything imports Ray
