"""What an elastic run records about its worker groups: progress notes, resize events, preemption.

Ray Train resizes a run by starting a new worker group from the newest checkpoint, telling the old
one nothing: so rank 0 of every group leaves a note (:class:`ProgressNote`) that the next reads
(:func:`resize_event`). On a preemption notice (:class:`PreemptionCheck`) the workers checkpoint at once.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any, Callable, Optional

from runtime.storage import Location

log = logging.getLogger(__name__)

NOTE_FILE = "satp-progress.json"
NOTE_EVERY_S = 0.2  # at most this often: a small file replaced on shared storage


@dataclasses.dataclass
class ProgressNote:
    """Rank 0's note of a worker group's progress (see the module docstring)."""

    run_dir: Location  # the run's folder (a local or shared one, or a prefix of an object store)
    command: Optional[float]  # when the satp command that started the fit began (its identity)
    world_size: int
    _written: float = float("-inf")

    def write(self, global_step: int, force: bool = False) -> None:
        """Note that ``global_step`` steps are done (at most every :data:`NOTE_EVERY_S` unless ``force``)."""
        now = time.time()
        if not force and now - self._written < NOTE_EVERY_S:
            return
        record = {"global_step": global_step, "world_size": self.world_size, "time": now, "command": self.command}
        note = self.run_dir.join(NOTE_FILE)
        try:
            note.write_bytes(json.dumps(record).encode())
        except OSError as exc:  # a note is worth less than the step: the event then says less
            log.warning("%s: progress note not written (%s)", note.uri, exc)
            return
        self._written = now


def read_note(run_dir: Location) -> Optional[dict[str, Any]]:
    """The previous worker group's note, or None (a fresh run, or an unreadable note)."""
    try:
        note = json.loads(run_dir.join(NOTE_FILE).read_bytes())
    except (OSError, ValueError):
        return None
    return note if isinstance(note, dict) and "global_step" in note and "world_size" in note else None


def resize_event(note: Optional[dict], command: Optional[float], world_size: int, resumed_step: int,
                 first_step_at: float) -> Optional[dict[str, Any]]:
    """What happened between the previous worker group (its ``note``) and this one, which resumed at
    ``resumed_step`` and finished its first step at ``first_step_at``: ``kind`` ``resize`` (another
    worker count, same command), ``restart`` (same count) or ``resume`` (a new command), the counts,
    ``steps_lost`` (a lower bound) and ``seconds`` without progress. None without a note."""
    if note is None:
        return None
    same_command = note.get("command") is not None and note.get("command") == command
    previous = int(note["world_size"])
    kind = "resume" if not same_command else ("resize" if previous != world_size else "restart")
    return {"kind": kind, "time": first_step_at, "from": previous, "to": world_size, "step": resumed_step,
            "steps_lost": max(0, int(note["global_step"]) - resumed_step),
            "seconds": round(first_step_at - float(note.get("time", first_step_at)), 3)}


def describe(event: dict[str, Any]) -> str:
    """One line: ``resize 2 -> 1 workers at step 12: 3 steps lost, 41.2 s without progress``."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(event["time"]))
    return (f"{event['kind']} {event['from']} -> {event['to']} workers at step {event['step']} ({when}): "
            f"{event['steps_lost']} step(s) lost, {event['seconds']:.1f} s without progress")


class PreemptionCheck:
    """Asks the trainer's context every ``every`` global steps (a collective) whether a node of the
    worker group is being drained; :meth:`notice` says it once per group."""

    def __init__(self, every: int, ask: Callable[[], Optional[Any]]) -> None:
        self.every, self.ask = int(every), ask
        self.noticed = False

    def notice(self, global_step: int) -> Optional[Any]:
        """The ``ray.train.PreemptionInfo`` of a new notice at this step (``ask``: the context's
        :meth:`~pipeline.train.context.TrainContext.preemption_notice`), else None."""
        if self.noticed or global_step % self.every:
            return None
        info = self.ask()
        if info is None:
            return None
        self.noticed = True
        return info
