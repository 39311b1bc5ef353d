"""Job files: one YAML per job, validated into typed sections at the edge.

A job YAML has the sections ``data``, ``transform``, ``shards`` (preprocessing),
``model`` (:class:`sat.SATConfig`), ``train``, ``resources``, ``mlflow`` and an
optional ``tune``. Unknown or mistyped keys are rejected with a one-line error
that names the file and the dotted key. ``--set dotted.key=value`` overrides
any key; the value is parsed as YAML (``--set train.lr=3e-4``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import TypeAdapter, ValidationError, field_validator

from pipeline.train_config import MlflowConfig, ResourcesConfig, TrainConfig
from pipeline.tune_config import TuneConfig
from preprocessing.config import DataConfig, ShardConfig, StrictModel, TransformConfig
from sat.config import SATConfig


_SAT_CONFIG = TypeAdapter(SATConfig)


class JobConfig(StrictModel):
    name: str
    model: SATConfig
    data: DataConfig
    transform: TransformConfig = TransformConfig()
    shards: ShardConfig = ShardConfig()
    train: TrainConfig = TrainConfig()
    resources: ResourcesConfig = ResourcesConfig()
    mlflow: MlflowConfig = MlflowConfig()
    tune: Optional[TuneConfig] = None  # ASHA sweep (satp tune), see pipeline.tune_config

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
        set_dotted(raw, key, yaml.safe_load(text), where="--set ")
    return raw


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


def format_validation_error(source: str, error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "<top>"
    message = first["msg"].removeprefix("Value error, ").removeprefix(f"{where}: ").removeprefix(f"{where}.")
    if first["type"] == "extra_forbidden":
        message = "unknown key"
    more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
    return f"{source}: {where}: {message}{more}"


def add_job_arguments(parser, example: str) -> None:
    """The arguments every job command takes: the job YAML, ``--set`` overrides, ``--address``."""
    parser.add_argument("job", help="job YAML (jobs/*.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override a job key, e.g. --set {example} (repeatable)")
    parser.add_argument("--address", default=None, help="Ray cluster address (default: a local Ray)")


def load_job(path: str | Path, overrides: list[str] | None = None) -> JobConfig:
    """Read, override and validate a job YAML; raise ``ValueError`` with a one-line message."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: job file not found")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping of sections at the top level")
    raw = apply_overrides(raw, overrides or [])
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as exc:
        raise ValueError(format_validation_error(str(path), exc)) from None
