"""Checkpoints (at epoch ends, every ``train.checkpoint_every_steps`` steps, on a preemption notice):
DeepSpeed engine state (``ds/``), the best weights (``best_model.pt``), the loop's state
(``state.json``) and every rank's file digests (``rank_<r>.json``, written last).

:class:`CheckpointManager` is the one place that writes, verifies, lists, picks and prunes a run
folder's checkpoints; one is resumed from only when it verifies whole. The copy is satp's, not Ray
Train's upload, so a full disk ends the run (:class:`StorageFull`) instead of being retried.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from preprocessing.shard_places import sha256_file
from preprocessing.write_errors import FULL, error_number
from runtime import command
from runtime.storage import Location, StorageSettings, resolve

DS_DIR = "ds"
TAG = "last"
STATE_FILE = "state.json"
BEST_FILE = "best_model.pt"
RANK_FILE = "rank_{rank}.json"
PREFIX = "checkpoint_"
SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train V2's record of a run's checkpoints
CHUNK = 1 << 22


class StorageFull(Exception):
    """A rank could not write its part of a checkpoint: no space left (raised on every rank)."""

    def __init__(self, path: str, checkpoint: str, epoch: int) -> None:
        super().__init__(f"{path}: no space left while writing the checkpoint of epoch {epoch}")
        self.details = {"path": path, "checkpoint": checkpoint, "epoch": epoch}


def save(directory: str | Path, engine, state: dict[str, Any], best_state_dict: Optional[dict], rank: int) -> Path:
    """Write this rank's part of a checkpoint into the local ``directory`` (a collective: every rank calls it)."""
    import torch

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


def load_state(directory: str | Path) -> dict[str, Any]:
    """The loop state of a local checkpoint directory; raises ``ValueError`` when it is incomplete."""
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise ValueError(f"{directory}: incomplete checkpoint (no {STATE_FILE})")
    return json.loads(path.read_text())


def restore(directory: str | Path, engine) -> dict[str, Any]:
    """Load the engine state (module, optimizer, scheduler) of a local checkpoint directory and
    return the loop state."""
    state = load_state(directory)
    path, client = engine.load_checkpoint(str(Path(directory) / DS_DIR), tag=TAG)
    if path is None:
        raise ValueError(f"{directory}: DeepSpeed could not load the engine state")
    if client.get("satp_epoch") != state["epoch"] or client.get("satp_steps") != state.get("steps"):
        raise ValueError(f"{directory}: engine state and loop state disagree on the epoch or the step")
    return state


def load_best_weights(directory: str | Path) -> Optional[dict]:
    import torch

    path = Path(directory) / BEST_FILE
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


def checkpoint_at(path: str, storage: Optional[StorageSettings] = None) -> tuple["CheckpointManager", str]:
    """The manager of the run folder that holds checkpoint ``path`` (a path or a URI), and its name."""
    run, name = str(path).rstrip("/").rsplit("/", 1)
    return CheckpointManager(run, storage=storage), name


class CheckpointManager:
    """The checkpoints of one run folder ``run`` (a path, a URI or a :class:`~runtime.storage.Location`;
    ``storage``: the job's settings of a URI's store). ``damaged``: what was named damaged already
    (the driver's, handed to the workers), so each is named once per run."""

    def __init__(self, run: str | os.PathLike | Location, damaged: Optional[dict[str, str]] = None,
                 storage: Optional[StorageSettings] = None) -> None:
        self.location = run if isinstance(run, Location) else resolve(run, storage, key="train.storage_path")
        self.fs, self.root = self.location.fs, self.location.path.rstrip("/")
        self.named = self.root if self.location.local else self.location.uri.rstrip("/")  # as messages name it
        self.damaged: dict[str, str] = dict(damaged or {})

    def path(self, name: str, *parts: str) -> str:
        """Checkpoint ``name`` (or a file in it) as messages name it: a path, or a URI on a store."""
        return "/".join((self.named, name, *parts))

    def _at(self, name: str, *parts: str) -> str:
        """The path of checkpoint ``name`` (or of a file in it) in the file system."""
        return "/".join((self.root, name, *parts))

    # ------------------------------------------------------------------ write
    def write(self, local: str | Path, rank: int, epoch: int, after_file: Optional[Callable[[int], None]] = None) -> str:
        """Copy this rank's part of a checkpoint (``local``, written by :func:`save`) into a new
        directory of the run; return its name. A collective: all ranks return, or all raise.
        ``after_file``: a test hook (:func:`pipeline.train.faults.pause_in_checkpoint`)."""
        from pipeline.train.metrics import broadcast_from_rank_zero, gather_objects

        local = Path(local)
        # named as Ray Train names its own (checkpoint_<date>_<time>)
        name = broadcast_from_rank_zero(f"{PREFIX}{datetime.datetime.now():%Y-%m-%d_%H-%M-%S.%f}" if rank == 0 else None)
        problem, relative = None, ""
        try:
            rank_file = RANK_FILE.format(rank=rank)
            for copied, relative in enumerate([*json.loads((local / rank_file).read_text())["files"], rank_file], 1):
                writing = self._at(name, relative)  # the list last
                self.fs.create_dir(writing.rsplit("/", 1)[0], recursive=True)
                with open(local / relative, "rb") as source, self.fs.open_output_stream(writing) as out:
                    while chunk := source.read(CHUNK):
                        out.write(chunk)
                if after_file is not None:
                    after_file(copied)
        except OSError as exc:
            problem = (error_number(exc), self.path(name, relative).rstrip("/"), exc.strerror or str(exc).splitlines()[0])
        problems = [p for p in gather_objects(problem) if p is not None]
        if problems:
            if rank == 0:  # every rank has stopped writing (they all reached the gather)
                self._delete(name)
            full = [p for p in problems if p[0] in FULL]
            if full:
                raise StorageFull(full[0][1], self.path(name), epoch)
            code, path, reason = problems[0]
            raise OSError(code, f"{path}: {reason} (writing the checkpoint of epoch {epoch})")
        return name

    # ------------------------------------------------------------------ read
    def state(self, name: str) -> dict[str, Any]:
        """The loop state of checkpoint ``name``; ``ValueError`` when it is missing or unreadable."""
        try:
            return json.loads(self.location.join(name, STATE_FILE).read_bytes())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{self.path(name, STATE_FILE)}: unreadable ({exc})") from None

    def progress(self, name: str) -> tuple[int, int]:
        """``(last epoch done, global step)`` of a checkpoint (``(-1, -1)``: unreadable): newer is
        larger, a checkpoint within an epoch after the one at the end of the epoch before."""
        try:
            state = self.state(name)
            return int(state.get("epoch", -1)), int(state.get("steps") or 0)
        except (ValueError, TypeError, AttributeError):
            return -1, -1

    def registered(self) -> list[str]:
        """The checkpoint names Ray Train's record (``checkpoint_manager_snapshot.json``) lists for
        the run: the ones it resumes from and deletes beyond ``checkpoints_to_keep``."""
        try:
            snapshot = json.loads(self.location.join(SNAPSHOT).read_bytes())
        except (OSError, ValueError):
            return []
        return [r["checkpoint_dir_name"] for r in snapshot.get("checkpoint_results") or [] if r.get("checkpoint_dir_name")]

    def list(self) -> list[str]:
        """The run's checkpoint names, newest first (by epoch and global step; a registered one wins a tie)."""
        import pyarrow.fs as pafs

        try:
            infos = self.location.children()
        except OSError:
            return []
        names = [i.base_name for i in infos if i.type == pafs.FileType.Directory and i.base_name.startswith(PREFIX)]
        registered = set(self.registered())
        return sorted(names, key=lambda n: (self.progress(n), n in registered, n), reverse=True)

    def verify(self, name: str) -> Optional[str]:
        """None when checkpoint ``name`` is whole (see the module docstring), else what is wrong, one
        line that starts with the file concerned. A listing of sizes only is checked by size."""
        state_path = self.path(name, STATE_FILE)
        try:
            state = json.loads(self.location.join(name, STATE_FILE).read_bytes())
        except FileNotFoundError:
            return f"{state_path}: missing (rank 0's part was never completely written)"
        except (OSError, ValueError) as exc:
            return f"{state_path}: unreadable ({exc})"
        world = state.get("world_size") if isinstance(state, dict) else None
        for rank in range(int(world or 0)):
            listing = self.path(name, RANK_FILE.format(rank=rank))
            try:
                files = json.loads(self.location.join(name, RANK_FILE.format(rank=rank)).read_bytes())
                files = files["files"] if "files" in files else {f: {"size": size} for f, size in files.items()}
            except FileNotFoundError:
                return f"{listing}: missing (rank {rank}'s part was never completely written)"
            except (OSError, ValueError, TypeError, AttributeError) as exc:
                return f"{listing}: unreadable ({exc})"
            for relative, recorded in files.items():
                problem = self._file_problem(self._at(name, relative), recorded)
                if problem:
                    return f"{self.path(name, relative)}: {problem}"
        return None

    def newest_intact(self, first: Optional[list[str]] = None, warn: bool = True) -> Optional[str]:
        """The checkpoint to resume from: the newest of ``first`` (Ray Train's registered one, the
        driver's choice) if it verifies, else the run's newest intact one, registered or not, so a
        rerun loses no epoch. One that fails is (``warn``) named once in a ``satp: warning:`` line
        with the checkpoint used instead. None: none is intact."""
        if first:
            newest = max(first, key=self.progress)
            if self.verify(newest) is None:
                return newest
        damaged, chosen = [], None
        for name in self.list():
            problem = self.verify(name)
            if problem is None:
                chosen = name
                break
            damaged.append((name, problem))
        instead = (f"the run goes on from {chosen} (epoch {self.progress(chosen)[0]})" if chosen is not None
                   else "no intact checkpoint is left: the run starts from its first epoch")
        for name, problem in damaged if warn else []:
            if problem not in self.damaged:
                epoch = self.progress(name)[0]
                what = f"epoch {epoch}" if epoch >= 0 else "epoch unknown"
                self.damaged[problem] = f"the checkpoint of {what} ({name})"
                command.warn(f"{problem}; checkpoint {name} ({what}) is damaged and not resumed from; {instead}")
        return chosen

    def load(self, name: str) -> tuple[dict[str, Any], Optional[dict]]:
        """The loop state and the best weights of checkpoint ``name``, verified first: a damaged one
        raises ``ValueError`` naming what is wrong (nothing registers weights from it)."""
        problem = self.verify(name)
        if problem:
            raise ValueError(problem)
        with self.local(name) as directory:
            return load_state(directory), load_best_weights(directory)

    @contextlib.contextmanager
    def local(self, name: str) -> Iterator[Path]:
        """A local directory holding checkpoint ``name`` (itself on a local file system, else a
        temporary copy), for DeepSpeed and ``torch.load``, which read local files."""
        if self.location.local:
            yield Path(self._at(name))
            return
        import pyarrow.fs as pafs

        with tempfile.TemporaryDirectory(prefix="satp-restore-") as tmp:
            pafs.copy_files(self._at(name), tmp, source_filesystem=self.fs, destination_filesystem=pafs.LocalFileSystem())
            yield Path(tmp)

    # ------------------------------------------------------------------ delete
    def prune(self, keep: Optional[str] = None) -> list[str]:
        """Delete the run's checkpoints that Ray's record does not list (an interrupted run's
        uploads, which Ray never prunes), except ``keep`` (the one a rerun resumes from); return their
        names. Without Ray's record nothing is deleted."""
        import logging

        import pyarrow.fs as pafs

        registered = set(self.registered())
        if not registered and self.fs.get_file_info(self._at(SNAPSHOT)).type == pafs.FileType.NotFound:
            return []
        removed = sorted(n for n in self.list() if n not in registered and n != keep)
        for name in removed:
            self._delete(name)
        if removed:
            logging.getLogger(__name__).info("removed %d checkpoint(s) of an interrupted run that Ray never "
                                             "registered: %s", len(removed), ", ".join(removed))
        return removed

    def clear(self, keep: str) -> None:
        """Delete everything the run folder holds (``--restart``) but the file ``keep`` (the lease).
        A symbolic link is removed, never followed (pyarrow's local file system would follow it)."""
        import pyarrow.fs as pafs

        if self.location.local:
            import shutil

            for path in Path(self.root).iterdir() if Path(self.root).is_dir() else []:
                if path.name == keep:
                    continue
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
            return
        for info in self.location.children():
            if info.base_name == keep:
                continue
            if info.type == pafs.FileType.Directory:
                self.fs.delete_dir(info.path)
            else:
                self.fs.delete_file(info.path)

    # ------------------------------------------------------------------ file system
    def _delete(self, name: str) -> None:
        with contextlib.suppress(OSError):
            self.fs.delete_dir(self._at(name))

    def _file_problem(self, path: str, recorded: dict) -> Optional[str]:
        import pyarrow.fs as pafs

        info = self.fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            return "missing"
        if info.size != recorded["size"]:
            how = "cut short" if info.size < recorded["size"] else "grown"
            return f"{info.size} bytes where {recorded['size']} were written ({how})"
        if "sha256" in recorded and sha256_file(self.fs.open_input_stream(path)) != recorded["sha256"]:
            return "its content differs from what was written (sha256 mismatch: changed since)"
        return None


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
