"""The ``compare:`` section of a job YAML: variants of the job, compared at equal budget over seeds.

Example (``jobs/pattern-local.yaml``)::

    compare:
      seeds: [0, 1, 2]              # every variant trains once per seed (train.seed)
      variants:                     # name -> dotted keys of the job set for that variant
        transformer: {model.k_hops: 0}
        subtree: {}                 # the job as it is
        subgraph: {model.extractor: subgraph, transform.k_hops: 1}

``satp compare JOB.yaml`` (:mod:`pipeline.sweep.compare`) trains every variant with every seed, each a
full Ray Train run at the same budget: the keys that set it (``data``, ``train.epochs``, the subsets)
and the seed cannot be varied; ``transform`` and ``shards`` may (each distinct preprocessing is built
once, before the trials). Every variant is validated as a job before anything starts.
"""
from __future__ import annotations

import re
from typing import Any, Optional

from pydantic import Field, field_validator

from preprocessing.config import StrictModel
from runtime.storage import validate

#: Keys a variant may not set: what identifies or logs the run, and what fixes the budget.
FORBIDDEN_PREFIXES = ("tune", "compare", "name", "mlflow", "data", "train.seed", "train.epochs", "train.train_subset",
                      "train.eval_subset", "train.run_name", "train.storage_path")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")  # usable in run names and MLflow metric keys


class CompareConfig(StrictModel):
    """Variants x seeds, each a full training run; see the module docstring."""

    variants: dict[str, Optional[dict[str, Any]]]  # None (an empty YAML value): the job as it is
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2])
    #: Comparison name (Tune experiment directory, MLflow parent run): default ``<job name>-compare-<hash>``.
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
        return None if value is None else validate(value, "compare.storage_path")

    @field_validator("variants")
    @classmethod
    def _variants(cls, variants: dict[str, Optional[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
        if not variants:
            raise ValueError("expected at least one variant")
        for name, overrides in variants.items():
            if not _NAME.match(str(name)):
                raise ValueError(f"{name!r}: a variant name takes letters, digits and _ . + - (not first)")
            for key in overrides or {}:
                if not key or any(not part for part in str(key).split(".")):
                    raise ValueError(f"{name}: {key!r}: expected dotted keys such as model.k_hops")
                if any(key == p or key.startswith(p + ".") for p in FORBIDDEN_PREFIXES):
                    raise ValueError(f"{name}: {key} cannot differ between variants (same data, epochs and seeds "
                                     "for every variant)")
        return {name: dict(overrides or {}) for name, overrides in variants.items()}

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, seeds: list[int]) -> list[int]:
        if not seeds:
            raise ValueError("expected at least one seed")
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"seeds repeat: {seeds}")
        return seeds
