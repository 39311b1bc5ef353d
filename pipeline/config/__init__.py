"""Job files: one YAML per job, validated into typed sections (:class:`JobConfig`); a bad key is one
line naming the file and the dotted key; ``--set dotted.key=value`` overrides any key (the value
parsed as YAML). Importing it loads no torch, Ray or MLflow.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError, field_validator, model_validator

from pipeline.config.train import MlflowConfig, ResourcesConfig, TrainConfig
from pipeline.config.compare import CompareConfig
from pipeline.config.storage import StorageConfig
from pipeline.config.tune import TuneConfig
from preprocessing.config import DataConfig, ShardConfig, StrictModel, TransformConfig
from sat.config import SATConfig


_SAT_CONFIG = TypeAdapter(SATConfig)


class JobConfig(StrictModel):
    name: str
    model: SATConfig
    data: DataConfig
    transform: TransformConfig = TransformConfig()
    shards: ShardConfig = ShardConfig()
    storage: StorageConfig = StorageConfig()  # shards.root a URI: the store's endpoint, the node's cache
    train: TrainConfig = TrainConfig()
    resources: ResourcesConfig = ResourcesConfig()
    mlflow: MlflowConfig = MlflowConfig()
    tune: Optional[TuneConfig] = None  # ASHA sweep (satp tune), see pipeline.config.tune
    compare: Optional[CompareConfig] = None  # variants x seeds (satp compare), see pipeline.config.compare

    @model_validator(mode="after")
    def _global_batch(self) -> "JobConfig":
        """``train.micro_batches_per_step`` unset: the job's (maximum) worker count, fixed here so that
        everything downstream (the configuration hash included) sees the number."""
        if self.train.micro_batches_per_step is None:
            self.train.micro_batches_per_step = self.resources.max_workers
        return self

    @field_validator("model", mode="before")
    @classmethod
    def _model_from_dict(cls, value: Any) -> SATConfig:
        if isinstance(value, SATConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError("expected a mapping")
        unknown = sorted(set(value) - set(SATConfig.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown keys {unknown}")
        return _SAT_CONFIG.validate_python(value)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``dotted.key=value`` overrides to a nested dict (values parsed as YAML)."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected dotted.key=value")
        set_dotted(raw, key, override_value(item, text), where="--set ")
    return raw


def override_value(item: str, text: str) -> Any:
    """The YAML value of ``--set KEY=VALUE`` (``item``); one-line ``ValueError`` when it is not valid
    YAML or carries a tag (``!!python/...``, ``!custom``: a job's values are plain data)."""
    try:
        tags = [e.tag for e in yaml.parse(text, Loader=yaml.SafeLoader) if getattr(e, "tag", None)]
        value = None if tags else yaml.safe_load(text)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"--set {item}: not valid YAML ({problem}); quote a value meant as text") from None
    if tags:
        shown = tags[0].replace("tag:yaml.org,2002:", "!!")
        raise ValueError(f"--set {item}: the value carries the YAML tag {shown}; a job takes plain values "
                         "(numbers, text, lists, mappings), without tags")
    return value


def set_dotted(raw: dict[str, Any], key: str, value: Any, where: str = "") -> None:
    """Set ``raw[a][b][c] = value`` for ``key = "a.b.c"``, creating missing sections."""
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ValueError(f"{where}{key}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def known_keys(loc: tuple) -> list[str]:
    """The keys a job YAML accepts at the mapping ``loc`` (``()``: the sections), for suggestions."""
    node: Any = JobConfig
    for part in loc:
        is_model = isinstance(node, type) and issubclass(node, BaseModel)
        field = node.model_fields.get(str(part)) if is_model else None
        node = field.annotation if field is not None else None
        args = [a for a in typing.get_args(node) if a is not type(None)]
        if args and not isinstance(node, type):
            node = args[0]  # Optional[X] -> X
    if isinstance(node, type) and issubclass(node, BaseModel):
        return list(node.model_fields)
    if dataclasses.is_dataclass(node):
        return [f.name for f in dataclasses.fields(node)]
    return []


def _close_key(key: str, loc: tuple) -> Optional[str]:
    close = difflib.get_close_matches(key, known_keys(loc), n=1, cutoff=0.6)
    return close[0] if close else None


def format_validation_error(source: str, error: ValidationError) -> str:
    """One line for a job's validation errors: an unknown key first, with the known key it resembles
    (a misspelt required section, also reported missing, counted once), else the first error."""
    errors = error.errors()
    unknown = [e for e in errors if e["type"] == "extra_forbidden"]
    first = unknown[0] if unknown else errors[0]
    loc = tuple(first["loc"])
    where = ".".join(str(p) for p in loc) or "<top>"
    message = first["msg"].removeprefix("Value error, ").removeprefix(f"{where}: ").removeprefix(f"{where}.")
    others = len(errors) - 1
    if first["type"] == "extra_forbidden":
        close = _close_key(str(loc[-1]), loc[:-1])
        message = "unknown key" + (f"; did you mean {close!r}?" if close else "")
        others -= sum(1 for e in errors if e["type"] == "missing" and tuple(e["loc"]) == loc[:-1] + (close,))
    else:
        bad = re.match(r"unknown keys \[(.*)\]$", message)  # the model section's own check
        names = re.findall(r"'([^']*)'", bad.group(1)) if bad else []
        close = _close_key(names[0], loc) if names else None
        if close:
            message += f"; did you mean {close!r}?"
    more = f" (and {others} more)" if others > 0 else ""
    return f"{source}: {where}: {message}{more}"


def yaml_error(path: Path, exc: Exception) -> str:
    """``job.yaml:14:3: not valid YAML: ... (while parsing a flow mapping opened at line 12, column 8)``:
    where PyYAML noticed the problem, and where an unclosed bracket or quote began."""
    mark = getattr(exc, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(exc, "problem", None) or (str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    context = getattr(exc, "context", None)
    opened = getattr(exc, "context_mark", None)
    if context and opened is not None:
        context += f" opened at line {opened.line + 1}, column {opened.column + 1}"
    return f"{where}: not valid YAML: {problem}" + (f" ({context})" if context else "")


def load_job(path: str | Path, overrides: list[str] | None = None) -> JobConfig:
    """Read, override and validate a job YAML; raise ``ValueError`` with a one-line message."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: job file not found")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(yaml_error(path, exc)) from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping of sections at the top level")
    raw = apply_overrides(raw, overrides or [])
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as exc:
        raise ValueError(format_validation_error(str(path), exc)) from None
