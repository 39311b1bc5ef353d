"""Names that become paths or registry entries, checked before anything starts: a run, sweep or
comparison name is a relative path in normal form inside its storage path (``x/y`` nests; ``../x``,
``/x``, ``x/../y``, ``x/`` are refused); the MLflow names follow MLflow's rules, written out here so
that the pre-flight imports no MLflow (``tests/test_names.py`` holds them against MLflow's).
"""
from __future__ import annotations

import posixpath
from typing import Iterator, Optional

#: MLflow's ``MAX_EXPERIMENT_NAME_LENGTH``.
MAX_EXPERIMENT_NAME = 500


def path_name_problem(name: str) -> Optional[str]:
    """Why ``name`` cannot name a folder inside its storage path (None: it can)."""
    if not name or not name.strip():
        return "empty"
    if "\0" in name:
        return "it holds a NUL character"
    if name.startswith("/"):
        return "an absolute path; expected a name inside the storage path (x, or x/y to nest)"
    parts = name.split("/")
    if ".." in parts:
        return "it leads out of the storage path ('..'); expected a name inside it (x, or x/y to nest)"
    if posixpath.normpath(name) != name:
        return f"not in normal form (it is the folder {posixpath.normpath(name)!r}); write that"
    return None


def registered_model_problem(name: str) -> Optional[str]:
    """MLflow's rule for registered model names (``_validate_model_name``), or None."""
    if not name or not name.strip():
        return "empty"
    if "/" in name or ":" in name:
        return "MLflow's registered model names cannot contain '/' or ':'"
    norm = posixpath.normpath(name)
    if norm != name or norm == "." or norm.startswith(".."):
        return f"MLflow refuses names that resolve to another name as a path (this one to {norm!r})"
    return None


def experiment_problem(name: str) -> Optional[str]:
    """MLflow's rule for experiment names (``_validate_experiment_name``), or None."""
    if not name.strip():
        return "empty or only spaces"
    if len(name) > MAX_EXPERIMENT_NAME:
        return f"{len(name)} characters; MLflow takes at most {MAX_EXPERIMENT_NAME}"
    return None


def _names(job) -> Iterator[tuple[str, str, Optional[str]]]:
    """``(key, value, problem)`` of every name of ``job`` that becomes a path or an MLflow name; a
    default taken from another key is named by both (``name (the default train.run_name)``)."""
    train = job.train
    key = "train.run_name" if train.run_name else "name (the default train.run_name)"
    yield key, train.run_name or job.name, path_name_problem(train.run_name or job.name)
    for section, suffix in (("tune", "-sweep"), ("compare", "-compare")):
        cfg = getattr(job, section)
        if cfg is None:
            continue
        value = cfg.name or f"{job.name}{suffix}"
        where = f"{section}.name" if cfg.name else f"name (the default {section}.name: {value})"
        yield where, value, path_name_problem(value)
    if job.mlflow.registered_model is not None:
        name = job.mlflow.registered_model
        yield "mlflow.registered_model", name, registered_model_problem(name)
    yield "mlflow.experiment", job.mlflow.experiment, experiment_problem(job.mlflow.experiment)


def check_names(job) -> None:
    """Raise ``ValueError`` (one line naming the key) for the first name of ``job`` that cannot be used."""
    for key, value, problem in _names(job):
        if problem:
            raise ValueError(f"{key}: {value!r}: {problem}")
