"""The ``tune:`` section of a job YAML: an ASHA sweep over dotted keys of the job (a whole one:
``jobs/code2-sweep-local.yaml``; every key in docs/jobs.md). A key such as ``"transform.rwpe_steps,
model.pe_dim"`` sets one value at both keys. Keys under ``data``, ``transform`` and ``shards`` change
the shards: they take ``choice``/``grid``/``value``, so that every variant is built once, before the trials.
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional

from pydantic import Field, field_validator, model_validator

from preprocessing.config import StrictModel
from runtime.storage import validate

DISTRIBUTIONS = ("choice", "grid", "uniform", "loguniform", "randint", "quniform", "value")
#: Keys a sweep may not vary (they identify the run or where it is logged).
FORBIDDEN_PREFIXES = ("tune", "name", "mlflow", "train.run_name", "train.storage_path")
#: Sections whose keys change the preprocessed shards.
DATA_SECTIONS = ("data", "transform", "shards")


class Distribution(StrictModel):
    """One search dimension: exactly one of the fields is set."""

    choice: Optional[list[Any]] = None
    grid: Optional[list[Any]] = None
    uniform: Optional[tuple[float, float]] = None
    loguniform: Optional[tuple[float, float]] = None
    randint: Optional[tuple[int, int]] = None
    quniform: Optional[tuple[float, float, float]] = None
    value: Any = None

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            raise ValueError(f"expected a mapping with one of {list(DISTRIBUTIONS)}, got {value!r}")
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> "Distribution":
        given = [k for k in DISTRIBUTIONS if k in self.model_fields_set]
        if len(given) != 1:
            raise ValueError(f"expected exactly one of {list(DISTRIBUTIONS)}, got {given or 'none'}")
        kind = given[0]
        if kind in ("choice", "grid") and not getattr(self, kind):
            raise ValueError(f"{kind}: expected a non-empty list")
        if kind in ("uniform", "loguniform", "randint", "quniform"):
            lo, hi = getattr(self, kind)[:2]
            if not lo < hi:
                raise ValueError(f"{kind}: expected low < high, got [{lo}, {hi}]")
            if kind == "loguniform" and lo <= 0:
                raise ValueError("loguniform: expected low > 0")
            if kind == "quniform" and self.quniform[2] <= 0:
                raise ValueError("quniform: expected q > 0")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in DISTRIBUTIONS if k in self.model_fields_set)

    @property
    def finite(self) -> bool:
        return self.kind in ("choice", "grid", "value")

    def candidates(self) -> list[Any]:
        """Values to validate: every value of a finite distribution, else the bounds."""
        kind = self.kind
        if kind in ("choice", "grid"):
            return list(getattr(self, kind))
        if kind == "value":
            return [self.value]
        if kind == "randint":
            return [self.randint[0], self.randint[1] - 1]
        return [float(v) for v in getattr(self, kind)[:2]]

    def to_tune(self):
        """The Ray Tune search-space object (``tune.choice``, ``tune.grid_search``, ... of the values)."""
        from ray import tune

        kind = self.kind
        if kind == "value":
            return self.value
        values = getattr(self, kind)
        if kind in ("choice", "grid"):
            return tune.choice(values) if kind == "choice" else tune.grid_search(values)
        return getattr(tune, kind)(*values)


class AshaConfig(StrictModel):
    """Ray Tune's ``ASHAScheduler`` (time unit: epochs = ``training_iteration``)."""

    grace_period: int = Field(1, ge=1)
    reduction_factor: float = Field(2.0, gt=1)
    max_epochs: Optional[int] = Field(None, ge=1)  # default: train.epochs
    brackets: int = Field(1, ge=1)


class TrialsConfig(StrictModel):
    """What a sweep and a comparison share: where they run, and how their trials are run."""

    SECTION: ClassVar[str] = "tune"
    #: Name (Tune experiment directory, MLflow parent run): default ``<job name>-sweep`` (a sweep),
    #: ``<job name>-compare-<hash>`` (a comparison).
    #: A rerun of the same job resumes it; another job under the same name is refused (``--restart``).
    name: Optional[str] = None
    #: Tune's storage (experiment state, trials' Train checkpoints): default ``<runs>/tune``.
    storage_path: Optional[str] = None
    max_concurrent_trials: Optional[int] = Field(None, ge=1)  # capped by the cluster's resources
    #: CPUs reserved by each trial's Tune function, which only drives its Train run.
    trial_cpus: float = Field(0.0, ge=0)
    #: Times a trial whose Train driver died is restarted (its Train run resumes).
    max_failures: int = Field(1, ge=0)

    @field_validator("storage_path")
    @classmethod
    def _storage_path_is_a_path_or_uri(cls, value: Optional[str]) -> Optional[str]:
        return None if value is None else validate(value, f"{cls.SECTION}.storage_path")


class TuneConfig(TrialsConfig):
    """An ASHA sweep: each trial is a full Ray Train run of the job with sampled settings."""

    space: dict[str, Distribution]
    metric: Optional[str] = None  # default: val_<task metric>
    mode: Optional[Literal["max", "min"]] = None  # default: the task's
    num_samples: int = Field(4, ge=1)
    seed: Optional[int] = 0
    asha: AshaConfig = AshaConfig()
    #: Register the best trial's model (under ``mlflow.registered_model``) at the end.
    register_best: bool = True

    @field_validator("space")
    @classmethod
    def _keys(cls, space: dict[str, Distribution]) -> dict[str, Distribution]:
        if not space:
            raise ValueError("expected at least one dotted key to sweep")
        seen: set[str] = set()
        for key, dist in space.items():
            for part in split_key(key):
                if not part or any(not p for p in part.split(".")):
                    raise ValueError(f"{key!r}: expected dotted keys such as train.lr")
                if any(part == p or part.startswith(p + ".") for p in FORBIDDEN_PREFIXES):
                    raise ValueError(f"{key!r}: {part} cannot be swept")
                if part in seen:
                    raise ValueError(f"{key!r}: {part} appears twice in the space")
                seen.add(part)
                if part.split(".")[0] in DATA_SECTIONS and not dist.finite:
                    raise ValueError(
                        f"{key!r}: keys that change preprocessing need choice, grid or value (got {dist.kind})"
                    )
        return space


def split_key(key: str) -> list[str]:
    """``"transform.rwpe_steps, model.pe_dim"`` -> ``["transform.rwpe_steps", "model.pe_dim"]``."""
    return [part.strip() for part in key.split(",")]
