"""What a sweep or comparison ran, recorded in its folder, so that its reruns behave like a run's.

Tune restores a sweep as it first ran: a job changed meanwhile would reach only the unfinished
trials. So the sweep records its job (``satp-sweep.json``), and a rerun of another job is refused
before Ray starts (:func:`check_rerun`) unless ``--restart`` empties the folder first.
"""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.train.checkpoint import CheckpointManager
from pipeline.train.lease import LEASE_FILE
from pipeline.train.rerun import differences
from runtime.storage import resolve

RECORD_FILE = "satp-sweep.json"
SECTIONS = ("tune", "compare")


def recorded_job(base: dict, section: str, settings: dict) -> dict:
    """The job a sweep runs, as recorded: ``base`` (the job as resolved, paths absolute) with its
    ``section``'s ``settings``, less what names the folder and what each trial sets itself."""
    job = {key: value for key, value in base.items() if key not in SECTIONS}
    job["train"] = {key: value for key, value in base["train"].items() if key not in ("run_name", "storage_path")}
    job[section] = {key: value for key, value in settings.items() if key not in ("name", "storage_path")}
    return json.loads(json.dumps(job, default=str))  # as it reads back


def check_rerun(sweep_dir: str | Path, record: dict, *, what: str, name: str, key: str, restart: bool,
                storage=None) -> None:
    """Refuse (a one-line ``ValueError``) to resume a sweep folder (a path, or a URI on the store the
    job's ``storage`` settings reach) that ran another job than ``record``, or that records none (run
    by an earlier satp); ``key``: the job key naming it."""
    folder = resolve(sweep_dir, storage, "tune.storage_path")
    if restart:
        return
    try:
        recorded = json.loads(folder.join(RECORD_FILE).read_bytes())
    except FileNotFoundError:
        if not any(info.base_name != LEASE_FILE for info in folder.children()):
            return  # nothing ran there yet
        held = f"a {what} that records no job (run before satp recorded one)"
    except (OSError, ValueError) as exc:
        held = f"a {what} whose record {RECORD_FILE} is unreadable ({exc})"
    else:
        diffs = differences(recorded, record)
        if not diffs:
            return
        shown = "; ".join(diffs[:4]) + (f" (and {len(diffs) - 4} more)" if len(diffs) > 4 else "")
        held = f"a {what} of another job ({shown})"
    raise ValueError(f"{what} {name!r} ({sweep_dir}) holds {held}; it is not resumed with this job: pick a new "
                     f"{key} (--set {key}={name}-2), or pass --restart to start it over (its folder and its trials' "
                     f"Train runs are deleted; MLflow runs and registered versions stay)")


def start(sweep_dir: str | Path, record: dict, restart: bool, storage=None) -> None:
    """Once the sweep is sure to start: with ``restart``, empty its folder (Tune's state and its
    trials' Train runs; the lease, which this command holds, stays), then write ``record`` (whole or
    not at all)."""
    folder = resolve(sweep_dir, storage, "tune.storage_path")
    if restart:
        CheckpointManager(folder).clear(keep=LEASE_FILE)
    folder.join(RECORD_FILE).write_bytes(json.dumps(record, indent=1, sort_keys=True).encode())
