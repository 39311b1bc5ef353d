"""Reruns: what a run name already holds, and what this job may do with it.

Ray Train resumes from the last checkpoint under a run name whenever it is fitted again: wrong for a
finished run or one of another configuration. So the plan's decision reads the run's newest intact
checkpoint (:func:`previous_run`) and compares a hash of everything that shapes the weights
(:func:`weights_config`): the same configuration resumes (or is ``finished``), another is a
:class:`RerunConflict`, no checkpoint is ``fresh``.

In the hash: the model section, the task, the ``train`` section but :data:`RESUMABLE_TRAIN_KEYS`,
and the shards' config hash and source fingerprint; not the ``resources`` nor ``mlflow`` sections.
The provenance also lists the git commits that trained the run, which a registered version records.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, Optional

#: ``train`` keys a resumed run may change (``eval_subset`` is not one: it picks the registered epoch).
RESUMABLE_TRAIN_KEYS = frozenset({
    "epochs", "eval_every", "eval_node_budget", "log_every_steps", "run_name", "storage_path",
    "checkpoints_to_keep", "checkpoint_every_steps", "preemption_check_steps", "max_failures", "loader_workers",
    "target", "patience",
    "step", "capacity_sigmas",  # how a step runs, not what it computes (pipeline.train.step)
})


class RerunConflict(ValueError):
    """The run name holds a checkpoint of another configuration (a one-line message)."""


def weights_config(job, manifest: dict, task_name: str) -> dict[str, Any]:
    """Everything that shapes the weights of a run (see the module docstring), JSON-ready, from the
    job and the shards' manifest only: what the task derives from the data is pinned by its hashes."""
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
    """``["train.lr 0.002 -> 0.01", ...]``: the dotted keys where ``old`` and ``new`` differ. A key
    that ``old`` lacks and ``new`` holds at its value in ``defaults`` (a setting added to satp since,
    left at its default) is no difference."""
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


@dataclasses.dataclass(frozen=True)
class Previous:
    """The newest intact checkpoint of a run name."""

    checkpoints: Any  # the run's pipeline.train.checkpoint.CheckpointManager
    name: str
    state: dict

    @property
    def checkpoint(self) -> str:
        return self.checkpoints.path(self.name)

    @property
    def epoch(self) -> int:
        return int(self.state.get("epoch", -1))

    @property
    def steps(self) -> int:
        return int(self.state.get("steps") or 0)

    @property
    def provenance(self) -> dict:
        return self.state.get("provenance") or {}

    @property
    def commits(self) -> list[str]:
        return list(self.provenance.get("git_commits") or [])


def previous_run(checkpoints, warn: bool = True) -> Optional[Previous]:
    """The newest intact checkpoint of a run (``checkpoints``: its
    :class:`~pipeline.train.checkpoint.CheckpointManager`; ``warn``: name what is damaged), or None."""
    name = checkpoints.newest_intact(warn=warn)
    if name is None:
        return None
    try:
        state = checkpoints.state(name)
    except ValueError as exc:
        raise ValueError(f"{exc}; pass --restart to start the run over") from None
    return Previous(checkpoints, name, state)


@dataclasses.dataclass(frozen=True)
class Decision:
    """What a run does with what its run name holds (:meth:`pipeline.train.plan.JobPlan.decision`)."""

    action: str  # fresh | resume | finished | restart
    previous: Optional[Previous]
    provenance: dict  # what the checkpoints of this run record (see the module docstring)


def stopped_by_rules(job, task_name: str, state: dict) -> Optional[str]:
    """Why the job's stopping rules end the run within the checkpoint's history (None: they do not)."""
    from pipeline.train import stopping
    from pipeline.tasks import TASK_CLASSES

    task = TASK_CLASSES[task_name]
    return stopping.stopped_within(state.get("history") or [], job.train, task.metric, task.mode)


def job_shard_dir(job, fingerprint: Optional[str] = None) -> Optional[Path | str]:
    """Where the job's shards are (or will be) for its raw files as they are now
    (:func:`preprocessing.shard_dir`; ``fingerprint``: the raw files', when the caller has it).
    None while the dataset folder is absent: it is built with the shards."""
    import preprocessing
    from preprocessing.sources import dataset_dir

    if fingerprint is None and not dataset_dir(job.data).exists():
        return None
    return preprocessing.shard_dir(job.data, job.transform, job.shards, fingerprint)  # a URI on a store


def job_manifest(job, fingerprint: Optional[str] = None) -> Optional[dict]:
    """The manifest of the job's shard directory (:func:`job_shard_dir`) when it exists (nothing
    is built or checked)."""
    from preprocessing.shard_places import open_place

    out = job_shard_dir(job, fingerprint)
    try:
        return json.loads(open_place(out, job.storage.settings()).read("manifest.json")) if out is not None else None
    except (OSError, ValueError):
        return None


def conflict_message(job, previous: Previous, diffs: list[str]) -> str:
    train = job.train
    shown = "; ".join(diffs[:4]) + (f" (and {len(diffs) - 4} more)" if len(diffs) > 4 else "")
    return (f"run {train.run_name!r} ({previous.checkpoints.named}) holds a checkpoint of another configuration "
            f"({shown}), after epoch {previous.epoch}; "
            f"it is not resumed into: pick a new run name (--set train.run_name={train.run_name}-2), "
            f"or pass --restart to start it over (its checkpoints are deleted; MLflow runs and registered "
            f"models stay)")
