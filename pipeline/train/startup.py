"""Where the time from ``satp train`` to the first training step goes: wall-clock events in the
driver and the rank-0 worker, whose differences are the phases of :data:`PHASES`, logged and reported
with the first epoch (``startup_<phase>_s``).
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Optional

#: (event that ends the phase, phase name), in order; a phase runs from the previous event to its own
PHASES = (
    ("plan", "imports"),  # the command's process started -> the job resolved, heavy imports done
    ("ray", "ray"),  # Ray started or joined, the cluster checked against the job
    ("shards", "data"),  # the shards found (or preprocessed)
    ("fit", "run_setup"),  # rerun decision, MLflow run opened
    ("worker_process", "worker_processes"),  # Ray Train's controller and placement, the rank-0 worker's process started
    ("worker", "worker_setup"),  # that process: imports (torch, PyG, DeepSpeed, satp), process group, loop entered
    ("loaders", "loaders"),  # datasets opened, batch capacities chosen, data loaders made
    ("engine", "engine"),  # model and DeepSpeed engine built, checkpoint restored
    ("first_batch", "first_batch"),  # the first batch out of the loader
    ("first_step", "first_step"),  # the first step, compilation and capture included
)


def process_started(pid: Optional[int] = None) -> float:
    """Wall-clock time at which process ``pid`` (default: this one) started, to the clock tick from
    ``/proc`` on Linux (psutil's is up to a second early)."""
    from pipeline.train.lease import process_started as start_ticks

    pid = pid or os.getpid()
    ticks = start_ticks(pid)
    if ticks is not None:
        with contextlib.suppress(OSError):
            with open("/proc/uptime") as f:
                return time.time() - (float(f.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK"))
    import psutil  # not Linux

    return float(psutil.Process(pid).create_time())


def breakdown(marks: dict[str, float]) -> dict[str, float]:
    """Seconds per phase of :data:`PHASES` for the events in ``marks`` (event -> wall-clock time;
    ``command``: the start), and ``to_first_step``; phases missing an end are left out. An event
    stamped before the one it follows ends its phase at zero, so the phases add up."""
    out: dict[str, float] = {}
    previous = marks.get("command")
    for event, phase in PHASES:
        if event not in marks:
            continue
        at = marks[event] if previous is None else max(marks[event], previous)
        if previous is not None:
            out[phase] = at - previous
        previous = at
    if "command" in marks and "first_step" in marks:
        out["to_first_step"] = marks["first_step"] - marks["command"]
    return out


#: not a phase's event: when the process the rank-0 worker was forked from had imported torch, PyG
#: and DeepSpeed (:mod:`runtime.fork_server`), in a forked worker's marks only
FORKED_FROM = "forked_from"


def warm(marks: dict[str, float]) -> Optional[bool]:
    """Whether the rank-0 worker ran in a process started before the workers were asked for (a
    forked one never is); None when the events are missing."""
    if "worker_process" not in marks or "fit" not in marks:
        return None
    return FORKED_FROM not in marks and marks["worker_process"] < marks["fit"]


def metrics(marks: dict[str, float]) -> dict[str, float]:
    """:func:`breakdown` as the run's MLflow metrics: ``startup_<phase>_s``, ``startup_warm_worker``
    (1: :func:`warm`) and ``startup_forked_worker`` (1: forked, :data:`FORKED_FROM`)."""
    out = {f"startup_{phase}_s": seconds for phase, seconds in breakdown(marks).items()}
    if warm(marks) is not None:
        out["startup_warm_worker"] = float(warm(marks))
        out["startup_forked_worker"] = float(FORKED_FROM in marks)
    return out


def describe(marks: dict[str, float]) -> str:
    """One line: ``start-up 21.4 s to the first step: imports 3.1 s, ray 5.0 s, ... (warm worker
    process)``."""
    parts = breakdown(marks)
    total = parts.pop("to_first_step", None)
    head = f"start-up {total:.1f} s to the first step" if total is not None else "start-up"
    line = head + ": " + ", ".join(f"{phase.replace('_', ' ')} {seconds:.1f} s" for phase, seconds in parts.items())
    state = warm(marks)
    if state is None:
        return line
    return f"{line} ({'warm' if state else 'forked' if FORKED_FROM in marks else 'new'} worker process)"
