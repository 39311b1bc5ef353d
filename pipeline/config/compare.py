"""The ``compare:`` section of a job YAML: variants of the job (name -> the dotted keys it sets; ``{}``:
the job as it is), each trained once per seed (``jobs/pattern-local.yaml``). At the same budget: ``data``,
the epochs, the subsets and the seed cannot vary (:data:`FORBIDDEN_PREFIXES`).
"""
from __future__ import annotations

import re
from typing import Any, ClassVar, Optional

from pydantic import Field, field_validator

from pipeline.config.tune import TrialsConfig

#: Keys a variant may not set: what identifies or logs the run, and what fixes the budget.
FORBIDDEN_PREFIXES = ("tune", "compare", "name", "mlflow", "data", "train.seed", "train.epochs", "train.train_subset",
                      "train.eval_subset", "train.run_name", "train.storage_path")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")  # usable in run names and MLflow metric keys


class CompareConfig(TrialsConfig):
    """Variants x seeds, each a full training run; see the module docstring."""

    SECTION: ClassVar[str] = "compare"
    variants: dict[str, Optional[dict[str, Any]]]  # None (an empty YAML value): the job as it is
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2])

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
