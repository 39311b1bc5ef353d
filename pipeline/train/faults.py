"""Test hooks of a worker: faults at chosen moments of a real run (``$SATP_TEST_FAULT``, JSON, or
``train_job(fault=...)``), each once per run (its ``marker`` file says it fired).
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Callable, Optional

TIMED = ("signal", "pause_in_checkpoint", "hold")  # faults that are not maybe_fail's kill


def maybe_fail(fault: dict, rank: int, epoch: int, step: int, seconds: float) -> None:
    """Kill this worker once, at step ``step`` of epoch ``epoch``, no sooner than ``seconds`` into
    the epoch (so that it lands after Ray Train registered the epoch before, however fast it runs)."""
    if rank != fault.get("rank", 0) or epoch != fault.get("epoch", 0) or step < fault.get("step", 0):
        return
    marker = Path(fault["marker"])
    if marker.exists():
        return
    time.sleep(max(0.0, fault.get("seconds", 0.0) - seconds))
    marker.write_text(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGKILL)


def maybe_signal(fault: dict, rank: int, epoch: int) -> None:
    """Once the checkpoint of epoch ``epoch`` is on storage (``ray.train.report`` has returned), send
    ``signal`` to the driver process ``pid``, once, then wait for the abort: the interrupt lands
    after the upload, and before or while Ray registers it."""
    if rank != 0 or epoch != fault.get("epoch", 0):
        return
    marker = Path(fault["marker"])
    if marker.exists():
        return
    marker.write_text(str(os.getpid()))
    os.kill(int(fault["pid"]), getattr(signal, fault["signal"]))
    time.sleep(120)


def maybe_hold(fault: dict, world_size: int, global_step: int, before: Callable[[], None]) -> None:
    """Wait for the end (Ray Train's teardown) after global step ``step`` in a group of ``world_size``,
    calling ``before`` first (the progress note, written whatever its throttle)."""
    hold = fault.get("hold") or {}
    if global_step == hold.get("step") and world_size == hold.get("world_size"):
        before()
        while True:
            time.sleep(1.0)


def pause_in_checkpoint(fault: Optional[dict], rank: int, global_step: int) -> Optional[Callable[[int], None]]:
    """The hook :meth:`pipeline.train.checkpoint.CheckpointManager.write` calls after each file it copies (its count
    so far): after the first, it writes the marker (this process's pid) and sleeps ``seconds``, once,
    on rank ``rank`` in the checkpoint of step ``step``; None where no such fault applies."""
    pause = (fault or {}).get("pause_in_checkpoint")
    if not pause or rank != pause.get("rank", 0) or global_step != pause.get("step"):
        return None
    marker = Path(fault["marker"])

    def hook(copied: int) -> None:
        if copied == 1 and not marker.exists():
            marker.write_text(str(os.getpid()))
            time.sleep(float(pause.get("seconds", 60.0)))

    return hook
