"""Reruns: what a run name already holds, and what this job may do with it.

A training run is named by ``train.storage_path`` + ``train.run_name``; Ray Train resumes from
the last checkpoint under that name whenever it is fitted again. That is right for a run that
was interrupted, and wrong for anything else: a run that finished would be "resumed" with nothing
to train and its model registered again, and a run of another configuration would load weights
of another shape, or, worse, of the same shape, and register them under a configuration that
did not train them. So before Ray Train starts, :func:`decide` reads the run's latest checkpoint
(:func:`latest_checkpoint`: no trainer needed) and compares a hash of everything that shapes the
weights (:func:`weights_config`), recorded in every checkpoint (``state.json["provenance"]``):

========================  ===============================================================
same configuration        the run continues from its checkpoint (``resume``), or, when it
                          has done ``train.epochs`` already, nothing is trained
                          (``finished``): its model is reported (registered if it was not)
another configuration     nothing starts (:class:`RerunConflict`, one line naming what
                          differs and the two ways on: a new ``train.run_name``, or
                          ``--restart``, which deletes the run's checkpoints and starts it
                          over in a new MLflow run; registered versions stay)
no checkpoint             a fresh run (``fresh``)
========================  ===============================================================

What is in the hash: the job's model section, the task, the ``train`` section except the keys below
(``train.micro_batches_per_step``, the global batch, stays in), and the data: the shards' config hash
and their source's fingerprint. The worker count is not: a step's global batch and the epoch's
sequence do not depend on it (:mod:`pipeline.train.global_batch`), so a run resumes, or Ray Train
resizes it, at any count, at the same global step with the same remaining global batches. Left out, because a resumed run may change them without changing
what its weights are: ``train.epochs`` (raising it continues a run; the learning-rate schedule
is laid out again over the new length, from the step reached), the stopping rules
(``train.target``, ``train.patience``: a run that stopped under the job's rules is finished, one
they no longer stop, e.g. at a higher target, continues; :mod:`pipeline.train.stopping`), evaluation cadence and batch size
(``eval_every``, ``eval_node_budget``), logging, checkpoint cadence and retention
(``checkpoint_every_steps``, ``preemption_check_steps``, ``checkpoints_to_keep``), ``max_failures``,
``loader_workers``, how the step runs (``step``, ``capacity_sigmas``: padded, compiled or captured
steps compute the same function), the run's name and storage path, the ``resources`` section (workers, their count included, may
run on other nodes) and the ``mlflow`` section. ``train.eval_subset`` stays in: it picks the
best epoch, i.e. the weights that get registered.

The checkpoint's provenance also lists the git commits of the code that trained it (one per
resumed segment when the code changed between them): a registered version records those.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import sys
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger(__name__)

#: ``train`` keys a resumed run may change (see the module docstring).
RESUMABLE_TRAIN_KEYS = frozenset({
    "epochs", "eval_every", "eval_node_budget", "log_every_steps", "run_name", "storage_path",
    "checkpoints_to_keep", "checkpoint_every_steps", "preemption_check_steps", "max_failures", "loader_workers",
    "target", "patience",
    "step", "capacity_sigmas",  # how a step runs, not what it computes (pipeline.train.step_modes)
})
SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train V2's record of a run's checkpoints
STATE_FILE = "state.json"


class RerunConflict(ValueError):
    """The run name holds a checkpoint of another configuration (a one-line message)."""


def weights_config(job, manifest: dict, task_name: Optional[str] = None) -> dict[str, Any]:
    """Everything that shapes the weights of a run (see the module docstring), JSON-ready.

    Read from the job and the shards' manifest only (no data, no Ray): what the task derives
    from the data (vocabulary, encoder widths) is pinned by the data's hashes. ``task_name``: the
    plan's (:class:`pipeline.train.plan.JobPlan`); without it, derived from the job."""
    if task_name is None:
        from pipeline.tasks import task_name_for

        task_name = task_name_for(job.train.task, job.data.name)
    return {
        "model": dataclasses.asdict(job.model),
        "task": task_name,
        "train": job.train.model_dump(mode="json", exclude=set(RESUMABLE_TRAIN_KEYS)),
        "data": {"config_hash": manifest.get("config_hash"),
                 "fingerprint": (manifest.get("source") or {}).get("fingerprint")},
    }


def data_settings(job) -> dict[str, Any]:
    """The job's data settings, to name what changed when the data hash differs (not hashed: the
    shards' config hash already covers what matters of them)."""
    return {"data": job.data.model_dump(mode="json", exclude={"root"}), "transform": job.transform.model_dump(mode="json"),
            "shards": {"graphs_per_shard": job.shards.graphs_per_shard}}


def config_hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


_ABSENT = object()


def _short(value: Any) -> str:
    if value is _ABSENT:
        return "(not recorded)"
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def differences(old: Any, new: Any, prefix: str = "", defaults: Any = _ABSENT) -> list[str]:
    """``["train.lr 0.002 -> 0.01", ...]``: the dotted keys where ``old`` and ``new`` differ.

    A key that ``old`` lacks and ``new`` holds at its value in ``defaults`` is no difference: a
    setting added to satp after the checkpoint was written, left at its default, changes nothing
    the checkpoint's run did."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            default = defaults.get(key, _ABSENT) if isinstance(defaults, dict) else _ABSENT
            out += differences(old.get(key, _ABSENT), new.get(key, _ABSENT), f"{prefix}{key}.", default)
        return out
    if old == new or (old is _ABSENT and defaults is not _ABSENT and new == defaults):
        return []
    return [f"{prefix[:-1]} {_short(old)} -> {_short(new)}"]


def default_config() -> dict[str, Any]:
    """:func:`weights_config`'s model and train parts at satp's defaults (see :func:`differences`)."""
    from pipeline.config.train import TrainConfig
    from sat.config import SATConfig

    return {"model": dataclasses.asdict(SATConfig()),
            "train": TrainConfig().model_dump(mode="json", exclude=set(RESUMABLE_TRAIN_KEYS))}


def config_differences(job, recorded: dict, config: dict, recorded_data: Optional[dict]) -> list[str]:
    """What differs between a checkpoint's recorded configuration and this job's, readably."""
    diffs = [d for d in differences(recorded, config, defaults=default_config()) if not d.startswith("data.")]
    if recorded.get("data") != config.get("data"):
        named = differences(recorded_data, data_settings(job)) if recorded_data is not None else []
        if ((recorded.get("data") or {}).get("fingerprint") != (config.get("data") or {}).get("fingerprint")):
            named.append("the source data (fingerprint of the raw files)")
        diffs += named or ["the shards (config hash)"]
    return diffs


def registered_checkpoints(run_dir: str | Path) -> list[str]:
    """The checkpoint directory names Ray Train's record (``checkpoint_manager_snapshot.json``)
    lists for a run: the ones it resumes from and deletes beyond ``checkpoints_to_keep``."""
    try:
        snapshot = json.loads((Path(run_dir) / SNAPSHOT).read_text())
    except (OSError, ValueError):
        return []
    return [r["checkpoint_dir_name"] for r in snapshot.get("checkpoint_results") or [] if r.get("checkpoint_dir_name")]


def _epoch(checkpoint: Path) -> int:
    return _progress(checkpoint)[0]


def _progress(checkpoint: Path) -> tuple[int, int]:
    """``(last epoch done, global step)`` of a checkpoint (``(-1, -1)``: unreadable): newer is larger,
    a checkpoint within an epoch after the one at the end of the epoch before."""
    try:
        state = json.loads((checkpoint / STATE_FILE).read_text())
        return int(state.get("epoch", -1)), int(state.get("steps") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        return -1, -1


#: damaged checkpoints named already, in this process or (:func:`resume_point`) by the driver: what
#: failed -> which checkpoint (one warning line each, once per run, not once per process)
_named: dict[str, str] = {}


def named_damage() -> dict[str, str]:
    """The damaged checkpoints named so far (what failed -> ``the checkpoint of epoch N (NAME)``)."""
    return dict(_named)


def latest_checkpoint(run_dir: str | Path, warn: bool = True) -> Optional[Path]:
    """The run's newest intact checkpoint on storage, by epoch and global step (no trainer needed).

    Ray Train resumes from the last checkpoint it registered; a run interrupted after its
    workers uploaded newer ones (Ray registers a report when it next polls them) has those on
    storage too, unregistered: they count as well, so a rerun loses no epoch; a registered one
    wins a tie. Each is verified, newest first, registered or not
    (:func:`pipeline.train.checkpoint.verify`: every rank's part there, each file with the size
    and digest recorded when it was written); one that fails is never used, and (``warn``) named
    in one ``satp: warning:`` line with the checkpoint used instead."""
    from pipeline.train import checkpoint as ckpt

    run_dir = Path(run_dir)
    registered = set(registered_checkpoints(run_dir))
    found = sorted((p for p in run_dir.glob("checkpoint_*") if p.is_dir()),
                   key=lambda p: (_progress(p), p.name in registered, p.name), reverse=True)
    damaged, chosen = [], None
    for path in found:
        problem = ckpt.verify(path)
        if problem is None:
            chosen = path
            break
        damaged.append((path, problem))
    instead = (f"the run goes on from {chosen.name} (epoch {_epoch(chosen)})" if chosen is not None
               else "no intact checkpoint is left: the run starts from its first epoch")
    for path, problem in damaged if warn else []:
        if problem not in _named:
            what = f"epoch {_epoch(path)}" if _epoch(path) >= 0 else "epoch unknown"
            _named[problem] = f"the checkpoint of {what} ({path.name})"
            print(f"satp: warning: {problem}; checkpoint {path.name} ({what}) is damaged and not resumed from; "
                  f"{instead}", file=sys.stderr, flush=True)
    return chosen


def resume_point(candidates: list[Path], run_dir: str | Path, named: Optional[dict[str, str]] = None) -> Optional[Path]:
    """The checkpoint the workers restore: the newest of ``candidates`` (Ray Train's registered one
    first, the driver's ``resume_from``; a tie goes to the first), if it verifies, else the run's
    newest intact one (:func:`latest_checkpoint`, which names what is damaged, except what the driver
    named already: ``named``, its :func:`named_damage`); None: none is intact."""
    from pipeline.train import checkpoint as ckpt

    _named.update(named or {})
    newest = max(candidates, key=_progress)
    return newest if ckpt.verify(newest) is None else latest_checkpoint(run_dir)


def clear_run(run_dir: str | Path) -> None:
    """Delete what a run folder holds (``--restart``), except the run's lease, which this command holds."""
    import shutil

    from pipeline.train.lease import LEASE_FILE

    for path in Path(run_dir).iterdir():
        if path.name == LEASE_FILE:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def prune_unregistered(run_dir: str | Path, keep: Optional[Path] = None) -> list[str]:
    """Delete the run's checkpoint directories that Ray's record does not list (an interrupted
    run's uploads, complete or not), except ``keep`` (the one a rerun resumes from, until Ray
    registers a newer one); return their names. Ray prunes only what it registered, so without
    this they would stay for good, beyond ``train.checkpoints_to_keep``."""
    import shutil

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    registered = set(registered_checkpoints(run_dir))
    if not registered and not (run_dir / SNAPSHOT).is_file():
        return []  # no record to go by (a run of another Ray, or none yet): delete nothing
    removed = []
    for path in sorted(run_dir.glob("checkpoint_*")):
        if path.is_dir() and path.name not in registered and (keep is None or path.resolve() != Path(keep).resolve()):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    if removed:
        log.info("removed %d checkpoint(s) of an interrupted run that Ray never registered: %s", len(removed),
                 ", ".join(removed))
    return removed


@dataclasses.dataclass
class Previous:
    """The latest checkpoint of a run name."""

    run_dir: Path
    checkpoint: Path
    state: dict

    @property
    def epoch(self) -> int:
        return int(self.state.get("epoch", -1))

    @property
    def provenance(self) -> dict:
        return self.state.get("provenance") or {}

    @property
    def commits(self) -> list[str]:
        return list(self.provenance.get("git_commits") or [])


def previous_run(storage_path: str, run_name: str, warn: bool = True) -> Optional[Previous]:
    """The newest intact checkpoint of a run name (:func:`latest_checkpoint`), or None."""
    run_dir = Path(storage_path) / run_name
    checkpoint = latest_checkpoint(run_dir, warn) if run_dir.is_dir() else None
    if checkpoint is None:
        return None
    try:
        state = json.loads((checkpoint / STATE_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{checkpoint / STATE_FILE}: unreadable ({exc}); pass --restart to start the run over") from None
    return Previous(run_dir, checkpoint, state)


@dataclasses.dataclass
class Decision:
    action: str  # fresh | resume | finished | restart
    previous: Optional[Previous]
    provenance: dict  # what the checkpoints of this run record (see the module docstring)


def decide(job, config: dict, commit: str, previous: Optional[Previous], restart: bool = False) -> Decision:
    """What this job does with its run name, which holds ``previous`` (:func:`previous_run`, found
    once per command: each verifies the checkpoint's files); raises :class:`RerunConflict` (see the
    module docstring)."""
    train = job.train
    digest = config_hash(config)
    fresh = {"config_hash": digest, "config": config, "data_settings": data_settings(job), "git_commits": [commit]}
    if previous is None:
        return Decision("fresh", None, fresh)
    if restart:
        return Decision("restart", previous, fresh)
    recorded = previous.provenance
    if recorded.get("config_hash") != digest:
        if recorded.get("config") is None:
            raise RerunConflict(conflict_message(job, previous, None))
        diffs = config_differences(job, recorded["config"], config, recorded.get("data_settings"))
        if diffs:
            raise RerunConflict(conflict_message(job, previous, diffs))
    commits = previous.commits or [commit]
    if commits[-1] != commit:
        commits.append(commit)
    provenance = dict(fresh, git_commits=commits)
    if previous.epoch >= train.epochs - 1 or stopped_by_rules(job, config["task"], previous.state):
        return Decision("finished", previous, dict(recorded, git_commits=previous.commits or [commit]))
    return Decision("resume", previous, provenance)


def stopped_by_rules(job, task_name: str, state: dict) -> Optional[str]:
    """Why the job's stopping rules end the run within the checkpoint's history (None: they do not)."""
    from pipeline.train import stopping
    from pipeline.tasks import TASK_CLASSES

    task = TASK_CLASSES[task_name]
    return stopping.stopped_within(state.get("history") or [], job.train, task.metric, task.mode)


def job_shard_dir(job, fingerprint: Optional[str] = None) -> Optional[Path]:
    """Where the job's shards are (or will be), for its raw files as they are now:
    ``<shards.root>/<dataset>-<config hash>-<raw fingerprint>`` (:func:`preprocessing.shard_dir`;
    ``fingerprint``: the raw files', when the caller has it). None while the dataset folder is
    absent: it is built with the shards."""
    import preprocessing
    from preprocessing.sources import dataset_dir

    if fingerprint is None and not dataset_dir(job.data).exists():
        return None
    return Path(preprocessing.shard_dir(job.data, job.transform, job.shards, fingerprint))


def job_manifest(job, fingerprint: Optional[str] = None) -> Optional[dict]:
    """The manifest of the job's shard directory (:func:`job_shard_dir`) when it exists (nothing
    is built or checked)."""
    out = job_shard_dir(job, fingerprint)
    try:
        return json.loads((out / "manifest.json").read_text()) if out is not None else None
    except (OSError, ValueError):
        return None


def early_decision(job, task_name: str, restart: bool, previous: Optional[Previous]) -> Optional[Decision]:
    """:func:`decide` before any data is built or Ray is started: a conflict raises at once, raw
    files that changed under the run included (their fingerprint is taken here, from its cache
    unless they changed); a finished run whose shards exist needs no Ray at all. None: decide
    after the data."""
    if restart or previous is None:
        return None
    import preprocessing
    from pipeline.registry.versions import git_commit
    from preprocessing.columnar import raw_fingerprint
    from preprocessing.sources import dataset_dir

    folder = dataset_dir(job.data)
    if folder.exists():
        fingerprint = raw_fingerprint(folder, job.data.name)
        manifest = job_manifest(job, fingerprint)
        if manifest is not None:
            return decide(job, weights_config(job, manifest, task_name), git_commit(), previous)
    else:  # built with the shards: everything but the raw data's fingerprint can be compared now
        fingerprint = ((previous.provenance.get("config") or {}).get("data") or {}).get("fingerprint")
    expected = {"config_hash": preprocessing.config_hash(job.data, job.transform, job.shards),
                "source": {"fingerprint": fingerprint}}
    decide(job, weights_config(job, expected, task_name), git_commit(), previous)  # raises on a conflict
    return None


def conflict_message(job, previous: Previous, diffs: Optional[list[str]]) -> str:
    train = job.train
    if diffs is None:
        what = "a checkpoint that records no configuration (written before satp recorded one)"
    else:
        shown = "; ".join(diffs[:4]) + (f" (and {len(diffs) - 4} more)" if len(diffs) > 4 else "")
        what = f"a checkpoint of another configuration ({shown})"
    return (f"run {train.run_name!r} ({previous.run_dir}) holds {what}, after epoch {previous.epoch}; "
            f"it is not resumed into: pick a new run name (--set train.run_name={train.run_name}-2), "
            f"or pass --restart to start it over (its checkpoints are deleted; MLflow runs and registered "
            f"models stay)")
