"""Tasks: what a dataset asks of the model, the loss and the metric.

A task owns the data-dependent fields of the model config (node and edge
encoders, head, classes), the training loss, turning model outputs into
per-graph predictions, OGB's official metric on them, and the best constant
predictor for reference. The training loop only talks to this interface, so it
has no dataset-name branches.

* ``code2`` (ogbg-code2 and the offline Python-source dataset): 5 subtoken
  heads over the vocabulary (top subtokens + ``__UNK__`` + ``__EOS__``),
  cross-entropy per position; predictions decoded to subtokens up to the first
  ``__EOS__``; F1 from ``ogb.graphproppred.Evaluator('ogbg-code2')`` against the
  graph's original subtokens (``y_tokens``).
* ``ppa`` (ogbg-ppa): 37-way graph classification, accuracy from
  ``Evaluator('ogbg-ppa')``.
"""
from __future__ import annotations

import dataclasses
import os
from collections import Counter
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from sat.config import SATConfig

EOS = "__EOS__"
UNK = "__UNK__"

# data.name -> task, for jobs that leave train.task unset
TASK_BY_DATASET = {
    "ogbg-code2": "code2",
    "code2": "code2",
    "pycode": "code2",
    "ogbg-ppa": "ppa",
    "ppa": "ppa",
    "synthetic-ppa": "ppa",
}


def _evaluator(name: str):
    os.environ.setdefault("OUTDATED_IGNORE", "1")
    from ogb.graphproppred import Evaluator

    return Evaluator(name)


class Task:
    """Interface of a task (see the module docstring)."""

    name: str = ""
    metric: str = ""  # name of the metric reported as train_/val_/test_<metric>
    mode: str = "max"

    def configure(self, config: SATConfig, sample: Any) -> SATConfig:
        """The model config with this task's encoder/head fields filled in (``sample``: one graph)."""
        raise NotImplementedError

    def loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        """The mean loss over the batch's :meth:`batch_size` units."""
        raise NotImplementedError

    def batch_size(self, batch: Any) -> int:
        """The number of units the loss averages over (graphs; nodes for node tasks), from the host."""
        return int(batch.num_graphs)

    def predictions(self, output: torch.Tensor) -> torch.Tensor:
        """Per-graph predictions as a tensor on the output's device (no host transfer)."""
        raise NotImplementedError

    def decode(self, predictions: torch.Tensor) -> list:
        """:meth:`predictions` (on the CPU) as plain Python objects, cheap to gather across ranks."""
        raise NotImplementedError

    def predict(self, output: torch.Tensor) -> list:
        """Per-graph predictions as plain Python objects."""
        return self.decode(self.predictions(output).cpu())

    def targets(self, batch: Any) -> list:
        """Per-graph targets as plain Python objects (read from a CPU batch)."""
        raise NotImplementedError

    def score(self, predictions: Sequence, targets: Sequence) -> float:
        raise NotImplementedError

    def constant_baseline(self, train_targets: Sequence, eval_targets: Sequence) -> float:
        """Metric on ``eval_targets`` of the best constant prediction chosen on ``train_targets``."""
        raise NotImplementedError

    def state(self) -> dict:
        """What is needed to rebuild the task for prediction (see :func:`make_task`)."""
        return {"name": self.name}


class Code2Task(Task):
    name = "code2"
    metric = "f1"

    def __init__(self, vocab: Sequence[str], max_seq_len: int = 5) -> None:
        if not vocab:
            raise ValueError("task code2 needs the subtoken vocabulary from the shards (none found)")
        self.vocab = list(vocab)
        if EOS not in self.vocab:
            raise ValueError(f"code2 vocabulary lacks {EOS}")
        self.eos = self.vocab.index(EOS)
        self.max_seq_len = int(max_seq_len)

    def configure(self, config: SATConfig, sample: Any) -> SATConfig:
        edge_attr = getattr(sample, "edge_attr", None)
        columns = int(edge_attr.size(-1)) if edge_attr is not None and edge_attr.dim() == 2 else 1
        edge_vocab = int(edge_attr.max()) + 1 if edge_attr is not None and edge_attr.numel() else 2
        return dataclasses.replace(
            config,
            node_encoder="code2_ast",
            edge_encoder="embedding" if config.use_edge_attr else "none",
            edge_in_dim=max(2, edge_vocab) if config.use_edge_attr else config.edge_in_dim,
            edge_in_columns=columns if config.use_edge_attr else config.edge_in_columns,
            head="code2_sequence",
            num_classes=len(self.vocab),
            max_seq_len=self.max_seq_len,
        )

    def loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        y = batch.y.view(-1, self.max_seq_len)
        return F.cross_entropy(output.float().reshape(-1, output.size(-1)), y.reshape(-1))

    def decode_ids(self, ids: Sequence[int]) -> list[str]:
        """Subtokens of one id sequence, up to the first ``__EOS__``."""
        out = []
        for i in ids:
            if int(i) == self.eos:
                break
            out.append(self.vocab[int(i)])
        return out

    def predictions(self, output: torch.Tensor) -> torch.Tensor:
        return output.argmax(-1)  # [B, max_seq_len] subtoken ids

    def decode(self, predictions: torch.Tensor) -> list:
        return [self.decode_ids(row) for row in predictions.tolist()]

    def targets(self, batch: Any) -> list:
        tokens = getattr(batch, "y_tokens", None)
        if tokens is None:  # fall back to the encoded targets
            return [self.decode_ids(row) for row in batch.y.view(-1, self.max_seq_len).tolist()]
        return [list(t) for t in tokens]

    def score(self, predictions: Sequence, targets: Sequence) -> float:
        if not targets:
            return float("nan")
        result = _evaluator("ogbg-code2").eval({"seq_ref": list(targets), "seq_pred": list(predictions)})
        return float(result["F1"])

    def constant_baseline(self, train_targets: Sequence, eval_targets: Sequence, candidates: int = 50) -> float:
        best = best_constant_sequence(train_targets, candidates, self.max_seq_len)
        return self.score([best] * len(eval_targets), eval_targets)

    def state(self) -> dict:
        return {"name": self.name, "max_seq_len": self.max_seq_len}


def _f1_of_set(label_sets: list[set], lengths: np.ndarray, indicator: np.ndarray, size: int) -> np.ndarray:
    tp = indicator
    precision = np.where(size > 0, tp / max(size, 1), 0.0)
    recall = np.where(lengths > 0, tp / np.maximum(lengths, 1), 0.0)
    denom = precision + recall
    return np.where(denom > 0, 2 * precision * recall / np.where(denom > 0, denom, 1), 0.0)


def best_constant_sequence(train_targets: Sequence[Sequence[str]], candidates: int = 50, max_len: int = 5) -> list[str]:
    """Greedy best constant subtoken sequence by mean F1 (OGB's per-graph set F1) on ``train_targets``."""
    label_sets = [set(t) for t in train_targets]
    if not label_sets:
        return []
    freq = Counter(tok for s in label_sets for tok in s)
    pool = [tok for tok, _ in freq.most_common(candidates)]
    lengths = np.array([len(s) for s in label_sets], dtype=np.float64)
    has = {tok: np.array([tok in s for s in label_sets], dtype=np.float64) for tok in pool}
    chosen: list[str] = []
    tp = np.zeros(len(label_sets))
    best_score = 0.0
    for _ in range(max_len):
        best_tok, best_tp = None, None
        for tok in pool:
            if tok in chosen:
                continue
            cand_tp = tp + has[tok]
            score = float(_f1_of_set(label_sets, lengths, cand_tp, len(chosen) + 1).mean())
            if score > best_score:
                best_score, best_tok, best_tp = score, tok, cand_tp
        if best_tok is None:
            break
        chosen.append(best_tok)
        tp = best_tp
    return chosen


class PPATask(Task):
    name = "ppa"
    metric = "acc"

    def __init__(self, num_classes: int = 37) -> None:
        self.num_classes = int(num_classes)

    def configure(self, config: SATConfig, sample: Any) -> SATConfig:
        edge_attr = getattr(sample, "edge_attr", None)
        x = getattr(sample, "x", None)
        node_encoder, node_in_dim = config.node_encoder, config.node_in_dim
        if node_encoder not in ("constant", "edge_sum"):
            if x is not None and x.is_floating_point():
                node_encoder, node_in_dim = "linear", int(x.size(-1))
            else:
                node_encoder, node_in_dim = "constant", 1
        if node_encoder == "edge_sum" and edge_attr is not None:
            node_in_dim = int(edge_attr.size(-1))
        use_edges = config.use_edge_attr and edge_attr is not None
        return dataclasses.replace(
            config,
            node_encoder=node_encoder,
            node_in_dim=node_in_dim,
            edge_encoder="linear" if use_edges else "none",
            edge_in_dim=int(edge_attr.size(-1)) if use_edges else config.edge_in_dim,
            head="graph_classification",
            num_classes=self.num_classes,
        )

    def loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.cross_entropy(output.float(), batch.y.view(-1).long())

    def predictions(self, output: torch.Tensor) -> torch.Tensor:
        return output.argmax(-1)

    def decode(self, predictions: torch.Tensor) -> list:
        return predictions.tolist()

    def targets(self, batch: Any) -> list:
        return batch.y.view(-1).cpu().tolist()

    def score(self, predictions: Sequence, targets: Sequence) -> float:
        if not targets:
            return float("nan")
        result = _evaluator("ogbg-ppa").eval(
            {"y_true": np.asarray(targets).reshape(-1, 1), "y_pred": np.asarray(predictions).reshape(-1, 1)}
        )
        return float(result["acc"])

    def constant_baseline(self, train_targets: Sequence, eval_targets: Sequence) -> float:
        if not train_targets:
            return float("nan")
        majority = Counter(train_targets).most_common(1)[0][0]
        return self.score([majority] * len(eval_targets), eval_targets)

    def state(self) -> dict:
        return {"name": self.name, "num_classes": self.num_classes}


def task_name_for(job_task: Optional[str], data_name: Optional[str]) -> str:
    if job_task:
        return job_task
    if data_name and data_name in TASK_BY_DATASET:
        return TASK_BY_DATASET[data_name]
    raise ValueError(
        f"train.task: not set and data.name {data_name!r} has no default task; set train.task to one of {['code2', 'ppa']}"
    )


def make_task(name: str, vocab: Optional[Sequence[str]] = None, **state: Any) -> Task:
    """Build a task by name (``state``: what :meth:`Task.state` returned, minus the name)."""
    state.pop("name", None)
    if name == "code2":
        return Code2Task(vocab or [], **state)
    if name == "ppa":
        return PPATask(**state)
    raise ValueError(f"unknown task {name!r}; expected one of ['code2', 'ppa']")
