"""Per-epoch checkpoints: DeepSpeed engine state + the loop's state + the best weights.

Layout of a checkpoint directory (each rank writes its own files into a local
temporary directory; Ray Train merges the ranks' directories into one in the
run's storage, and registers the checkpoint only once every rank has reported,
so a checkpoint is complete or absent)::

    ds/latest, ds/<tag>/...   DeepSpeed engine: module, optimizer (per ZeRO rank), lr scheduler
    best_model.pt             rank 0: fp32 state dict of the best epoch by validation
    state.json                rank 0: epoch, steps, wall-clock, sampler state, best-so-far,
                              metric history, MLflow run id, model config, task, world size
    rank_<r>.json             every rank, written last: its files and their sizes

Ray Train registers a checkpoint once every rank has reported it, but a run interrupted between
the upload and the registration leaves a checkpoint on storage that Ray's record does not list
(:mod:`pipeline.train.rerun` resumes from it all the same). Such a directory is trusted only when
:func:`is_complete`: every rank's file list is there and each listed file has its size.
``state.json`` alone marks what :func:`load_state` accepts.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import torch

DS_DIR = "ds"
TAG = "last"
STATE_FILE = "state.json"
BEST_FILE = "best_model.pt"
RANK_FILE = "rank_{rank}.json"


def save(directory: str | Path, engine, state: dict[str, Any], best_state_dict: Optional[dict], rank: int) -> Path:
    """Write this rank's part of a checkpoint into ``directory`` (a collective: every rank calls it)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    engine.save_checkpoint(str(directory / DS_DIR), tag=TAG, client_state={"satp_epoch": state["epoch"]})
    if rank == 0:
        if best_state_dict is not None:
            tmp = directory / (BEST_FILE + ".tmp")
            torch.save(best_state_dict, tmp)
            os.replace(tmp, directory / BEST_FILE)
        tmp = directory / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=1, default=_jsonable))
        os.replace(tmp, directory / STATE_FILE)
    # this rank's directory holds its files only (Ray Train merges the ranks' directories)
    files = {str(p.relative_to(directory)): p.stat().st_size for p in directory.rglob("*") if p.is_file()}
    (directory / RANK_FILE.format(rank=rank)).write_text(json.dumps(files))
    return directory


def is_complete(directory: str | Path) -> bool:
    """Whether every rank's part of the checkpoint in ``directory`` is all there (see the module
    docstring); a checkpoint written before satp listed the ranks' files counts by its state."""
    directory = Path(directory)
    try:
        state = load_state(directory)
        world = state.get("world_size")
        if world is None:
            return True
        for rank in range(int(world)):
            files = json.loads((directory / RANK_FILE.format(rank=rank)).read_text())
            if any((directory / name).stat().st_size != size for name, size in files.items()):
                return False
    except (OSError, ValueError):
        return False
    return True


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
    if client.get("satp_epoch") != state["epoch"]:
        raise ValueError(f"{directory}: engine state and loop state disagree on the epoch")
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
