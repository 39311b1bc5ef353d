"""The ``data``, ``transform`` and ``shards`` sections of a job YAML.

Example (``jobs/code2-local.yaml``)::

    data:
      name: ogbg-code2          # or ogbg-ppa
      root: data                # OGB root: holds data/ogbg_code2/ (OGB's raw layout)
      source: pycode            # what creates root/ogbg_code2 when it is absent:
                                #   ogb (download), pycode (Python source), synthetic (ogbg-ppa only)
      source_dirs: []           # pycode: source directories (empty = this interpreter's stdlib)
      max_graphs_per_split: 2000  # quick runs: a seeded subset of each split (null = all)
    transform:
      rwpe_steps: 20            # 0 = no RWPE
      lap_pe_dim: 0             # 0 = no Laplacian PE
      k_hops: 2                 # k-hop subgraph indices; 0 = not stored
      vocab_size: 5000          # code2: top subtokens of the train split (+ __UNK__, __EOS__)
    shards:
      root: runs/shards         # shard directories are root/<dataset>-<config hash>
      graphs_per_shard: 2048

Every model is strict (``extra='forbid'``): unknown keys and mistyped values are
errors. This module must not import :mod:`pipeline` (``pipeline.config`` imports it).
"""
from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DATASETS = ("ogbg-code2", "ogbg-ppa")
SPLITS = ("train", "valid", "test")


class StrictModel(BaseModel):
    """Base of every job-file section: unknown keys are errors, values are validated."""

    model_config = ConfigDict(extra="forbid")


class DataConfig(StrictModel):
    """Which dataset, where its OGB raw layout lives, and how to create it when absent."""

    name: Literal["ogbg-code2", "ogbg-ppa"]
    #: OGB root directory: the dataset lives in ``root/ogbg_code2`` or ``root/ogbg_ppa``.
    root: str = "data"
    #: Builder used when ``root`` lacks the dataset: ``ogb`` downloads it (needs internet),
    #: ``pycode`` builds ogbg-code2 from Python source, ``synthetic`` writes a synthetic ogbg-ppa.
    source: Literal["ogb", "pycode", "synthetic"] = "ogb"
    #: ``pycode`` only: source directories (empty: the running interpreter's standard library).
    source_dirs: list[str] = Field(default_factory=list)
    #: ``pycode`` only: keep test directories (excluded by default).
    include_tests: bool = False
    #: ``synthetic`` only: number of graphs to generate.
    synthetic_graphs: int = Field(default=2000, ge=3)
    #: Quick runs: keep a seeded random subset of at most this many graphs per split (None = all).
    max_graphs_per_split: int | None = Field(default=None, ge=1)
    #: Seed of the subset above and of the synthetic generator.
    seed: int = 0

    @model_validator(mode="after")
    def _source_matches_name(self) -> "DataConfig":
        if self.source == "pycode" and self.name != "ogbg-code2":
            raise ValueError(f"source 'pycode' builds ogbg-code2, not {self.name}")
        if self.source == "synthetic" and self.name != "ogbg-ppa":
            raise ValueError(f"source 'synthetic' builds ogbg-ppa, not {self.name}")
        return self


class TransformConfig(StrictModel):
    """Per-graph features precomputed into the shards."""

    #: RWPE steps p (random-walk return probabilities for 1..p steps); 0 = not stored.
    rwpe_steps: int = Field(default=20, ge=0, le=256)
    #: Laplacian PE dimension; 0 = not stored.
    lap_pe_dim: int = Field(default=0, ge=0, le=256)
    #: k of the k-hop subgraph indices read by the k-subgraph extractor; 0 = not stored.
    k_hops: int = Field(default=2, ge=0, le=8)
    #: code2: size of the target vocabulary (top subtokens of the train split), clamped to the
    #: number of distinct subtokens; ``__UNK__`` and ``__EOS__`` come after it.
    vocab_size: int = Field(default=5000, ge=1)
    #: code2: number of predicted subtokens (target length, EOS-padded).
    max_seq_len: int = Field(default=5, ge=1)
    #: code2: OGB's ``augment_edge`` (reverse AST edges, next-token edges, ``edge_attr`` [E, 2]).
    augment_edge: bool = True
    #: ppa: node input ``x``: ``zeros`` ([N, 1] long, for ``Embedding(1, d)``) or ``edge_sum``
    #: ([N, 7] float32, the sum of incident edge features).
    ppa_node_input: Literal["zeros", "edge_sum"] = "zeros"


class ShardConfig(StrictModel):
    """Where and how the Arrow shards are written."""

    #: Base directory; each configuration writes to ``root/<dataset>-<hash>``.
    root: str = "runs/shards"
    #: Target shard size in graphs (a shard never mixes splits).
    graphs_per_shard: int = Field(default=2048, ge=1)
    #: Most shard tasks submitted at once (None: twice the tasks the cluster's CPUs can run).
    max_in_flight: int | None = Field(default=None, ge=1)
    #: CPUs reserved by each Ray task.
    cpus_per_task: float = Field(default=1.0, gt=0)


def config_hash(data: DataConfig, transform: TransformConfig, shards: ShardConfig) -> str:
    """Hash of everything that changes the shards' contents (not where they are written)."""
    keyed = {
        "data": data.model_dump(mode="json", exclude={"root"}),
        "transform": transform.model_dump(mode="json"),
        "shards": {"graphs_per_shard": shards.graphs_per_shard},
    }
    # transform fields that do not apply to the dataset do not change the shards
    if data.name == "ogbg-ppa":
        for key in ("vocab_size", "max_seq_len", "augment_edge"):
            keyed["transform"].pop(key)
    else:
        keyed["transform"].pop("ppa_node_input")
    text = json.dumps(keyed, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()
