"""Checkpoints (at epoch ends, every ``train.checkpoint_every_steps`` steps, on a preemption notice):
DeepSpeed engine state + the loop's state + the best weights.

Layout of a checkpoint directory (each rank writes its own files into a local temporary
directory, :func:`save`, then copies them into the run's storage, :func:`persist`; the ranks'
parts make one directory there, which Ray Train registers once every rank has reported it)::

    ds/latest, ds/<tag>/...   DeepSpeed engine: module, optimizer (per ZeRO rank), lr scheduler
    best_model.pt             rank 0: fp32 state dict of the best epoch by validation
    state.json                rank 0: last epoch done, global step, the position in the epoch's
                              sequence (pipeline.train.global_batch.Position), wall-clock,
                              best-so-far, metric history, MLflow run id, model config, task,
                              world size (the ranks that wrote parts), worker-group events
    rank_<r>.json             every rank, written last: its files, their sizes and sha256 digests

A checkpoint is resumed from only when :func:`verify` finds it whole: every rank's list is there,
and every file it lists has the size and the digest recorded when it was written. That catches a
part never written (a rank killed, or the run interrupted, between the upload and Ray Train's
registration), a file cut short (a disk error, a copy stopped half-way) and one changed since (a
flipped bit, an overwrite). It runs before any resume: in the driver for the checkpoint a rerun
starts from (:func:`pipeline.train.rerun.latest_checkpoint`) and in the workers for Ray Train's
registered one (:func:`pipeline.train.rerun.resume_point`); what fails is named in one line and the
newest intact checkpoint is used instead.

The copy into storage is satp's (:func:`persist`), not Ray Train's upload, so that a full disk ends
the run: a worker whose upload fails is a failed worker, which Ray Train restarts ``max_failures``
times, each attempt leaving another partial checkpoint on the disk that is full. Here every rank
copies its part, the ranks compare outcomes, and on any failure rank 0 removes the partial
checkpoint and all ranks raise together: :class:`StorageFull` when the disk (or a quota) is full,
which the workers' entry turns into the end of the run (:func:`pipeline.train.driver.worker_main`),
else the ``OSError`` (a worker failure, retried as before). The checkpoint is then reported to Ray
Train as it lies in storage (``CheckpointUploadMode.NO_UPLOAD``).
"""
from __future__ import annotations

import datetime
import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from preprocessing.shards import sha256_file

DS_DIR = "ds"
TAG = "last"
STATE_FILE = "state.json"
BEST_FILE = "best_model.pt"
RANK_FILE = "rank_{rank}.json"
FULL = (errno.ENOSPC, errno.EDQUOT)  # the disk, or the user's quota, is full


class StorageFull(Exception):
    """A rank could not write its part of a checkpoint: no space left (raised on every rank)."""

    def __init__(self, path: str, checkpoint: str, epoch: int) -> None:
        super().__init__(f"{path}: no space left while writing the checkpoint of epoch {epoch}")
        self.details = {"path": path, "checkpoint": checkpoint, "epoch": epoch}


def save(directory: str | Path, engine, state: dict[str, Any], best_state_dict: Optional[dict], rank: int) -> Path:
    """Write this rank's part of a checkpoint into ``directory`` (a collective: every rank calls it)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    engine.save_checkpoint(str(directory / DS_DIR), tag=TAG,
                           client_state={"satp_epoch": state["epoch"], "satp_steps": state.get("steps")})
    if rank == 0:
        if best_state_dict is not None:
            tmp = directory / (BEST_FILE + ".tmp")
            torch.save(best_state_dict, tmp)
            os.replace(tmp, directory / BEST_FILE)
        tmp = directory / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=1, default=_jsonable))
        os.replace(tmp, directory / STATE_FILE)
    # this rank's directory holds its files only (the ranks' parts meet in storage)
    files = {str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(directory.rglob("*")) if p.is_file()}
    (directory / RANK_FILE.format(rank=rank)).write_text(json.dumps({"files": files}))
    return directory


def checkpoint_name() -> str:
    """A new checkpoint's directory name, as Ray Train names its own (``checkpoint_<date>_<time>``)."""
    return f"checkpoint_{datetime.datetime.now().strftime('%Y-%m-%d_%H-%M-%S.%f')}"


def persist(local: str | Path, run_dir: str | Path, rank: int, epoch: int,
            after_file: Optional[Callable[[int], None]] = None) -> str:
    """Copy this rank's part of a checkpoint (``local``, written by :func:`save`) into a new directory
    of the run's storage ``run_dir``; return its name. A collective: every rank calls it, and all
    return, or all raise (see the module docstring). ``after_file``: called with the count of files
    copied so far (a test hook: :func:`pipeline.train.faults.pause_in_checkpoint`)."""
    from pipeline.train.metrics import broadcast_from_rank_zero, gather_objects

    local = Path(local)
    name = broadcast_from_rank_zero(checkpoint_name() if rank == 0 else None)
    target = Path(run_dir) / name
    problem, writing = None, target
    try:
        rank_file = RANK_FILE.format(rank=rank)
        for copied, relative in enumerate([*json.loads((local / rank_file).read_text())["files"], rank_file], 1):
            writing = target / relative  # the list last
            writing.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(local / relative, writing)
            if after_file is not None:
                after_file(copied)
    except OSError as exc:
        problem = (exc.errno, str(writing), exc.strerror or str(exc))
    problems = [p for p in gather_objects(problem) if p is not None]
    if problems:
        if rank == 0:  # every rank has stopped writing (they all reached the gather)
            shutil.rmtree(target, ignore_errors=True)
        full = [p for p in problems if p[0] in FULL]
        if full:
            raise StorageFull(full[0][1], str(target), epoch)
        code, path, reason = problems[0]
        raise OSError(code, f"{path}: {reason} (writing the checkpoint of epoch {epoch})")
    return name


def verify(directory: str | Path) -> Optional[str]:
    """None when the checkpoint in ``directory`` is whole (see the module docstring), else what is
    wrong, one line that starts with the file concerned. A checkpoint written before satp listed
    the ranks' files counts by its state; one listing sizes only (before digests) by its sizes."""
    directory = Path(directory)
    try:
        state = json.loads((directory / STATE_FILE).read_text())
    except FileNotFoundError:
        return f"{directory / STATE_FILE}: missing (rank 0's part was never completely written)"
    except (OSError, ValueError) as exc:
        return f"{directory / STATE_FILE}: unreadable ({exc})"
    world = state.get("world_size") if isinstance(state, dict) else None
    for rank in range(int(world or 0)):
        listing = directory / RANK_FILE.format(rank=rank)
        try:
            files = json.loads(listing.read_text())
            files = files["files"] if "files" in files else {name: {"size": size} for name, size in files.items()}
        except FileNotFoundError:
            return f"{listing}: missing (rank {rank}'s part was never completely written)"
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            return f"{listing}: unreadable ({exc})"
        for name, recorded in files.items():
            problem = _file_problem(directory / name, recorded)
            if problem:
                return f"{directory / name}: {problem}"
    return None


def _file_problem(path: Path, recorded: dict) -> Optional[str]:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "missing"
    if size != recorded["size"]:
        how = "cut short" if size < recorded["size"] else "grown"
        return f"{size} bytes where {recorded['size']} were written ({how})"
    if "sha256" in recorded and sha256_file(path) != recorded["sha256"]:
        return "its content differs from what was written (sha256 mismatch: changed since)"
    return None


def is_complete(directory: str | Path) -> bool:
    """Whether :func:`verify` finds the checkpoint in ``directory`` whole."""
    return verify(directory) is None


def load_state(directory: str | Path) -> dict[str, Any]:
    """The loop state of a checkpoint directory; raises ``ValueError`` when it is incomplete."""
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise ValueError(f"{directory}: incomplete checkpoint (no {STATE_FILE})")
    return json.loads(path.read_text())


def restore(directory: str | Path, engine) -> dict[str, Any]:
    """Load the engine state (module, optimizer, scheduler) and return the loop state."""
    state = load_state(directory)
    path, client = engine.load_checkpoint(str(Path(directory) / DS_DIR), tag=TAG)
    if path is None:
        raise ValueError(f"{directory}: DeepSpeed could not load the engine state")
    if client.get("satp_epoch") != state["epoch"] or client.get("satp_steps") != state.get("steps"):
        raise ValueError(f"{directory}: engine state and loop state disagree on the epoch or the step")
    return state


def load_best_weights(directory: str | Path) -> Optional[dict]:
    path = Path(directory) / BEST_FILE
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
