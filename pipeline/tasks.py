"""Tasks: what a dataset asks of the model (encoders, head, classes), its loss, predictions, OGB's
official metric and the best constant predictor, so that the training loop has no dataset branches.
``code2``: 5 subtoken heads, F1 against the original subtokens; ``ppa``: 37-way graph classification;
``pattern`` / ``cluster``: node classification with benchmarking-gnns' weighted loss and
class-averaged accuracy.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
from collections import Counter
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from sat.config import SATConfig
from sat.padding import PAD_TARGET, padding_of

EOS = "__EOS__"
UNK = "__UNK__"

# data.name -> task, for jobs that leave train.task unset
TASK_BY_DATASET = {"ogbg-code2": "code2", "ogbg-ppa": "ppa", "pattern": "pattern", "cluster": "cluster"}


def _evaluator(name: str):
    os.environ.setdefault("OUTDATED_IGNORE", "1")
    from ogb.graphproppred import Evaluator

    return Evaluator(name)


class Task:
    """Interface of a task (see the module docstring)."""

    name: str = ""
    metric: str = ""  # name of the metric reported as train_/val_/test_<metric>
    mode: str = "max"
    node_level: bool = False  # predictions and targets per node (in batch order), not per graph

    def configure(self, config: SATConfig, sample: Any) -> SATConfig:
        """The model config with this task's encoder/head fields filled in (``sample``: one graph)."""
        raise NotImplementedError

    def loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        """The mean loss over the batch's :meth:`batch_size` units (a padded batch's padding units,
        whose targets are ``sat.padding.PAD_TARGET``, count for nothing)."""
        raise NotImplementedError

    def batch_size(self, batch: Any) -> int:
        """The number of units the loss averages over (graphs; nodes for node tasks), from the host;
        of a padded batch (:mod:`sat.padding`), its own graphs or nodes."""
        padding = padding_of(batch)
        if padding is not None:
            return padding.nodes if self.node_level else padding.graphs
        return int(batch.num_nodes if self.node_level else batch.num_graphs)

    def real_rows(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        """The rows of ``output`` (or of :meth:`predictions`) that belong to the batch's own units: a
        padded batch's first :meth:`batch_size` rows (a view: no host read), any other batch's all."""
        return output if padding_of(batch) is None else output[: self.batch_size(batch)]

    def predictions(self, output: torch.Tensor) -> torch.Tensor:
        """Per-unit predictions as a tensor on the output's device (no host transfer): the top class."""
        return output.argmax(-1)

    def decode(self, predictions: torch.Tensor) -> list:
        """:meth:`predictions` (on the CPU) as plain Python objects, cheap to gather across ranks."""
        return predictions.tolist()

    def predict(self, output: torch.Tensor) -> list:
        """Per-graph predictions as plain Python objects."""
        return self.decode(self.predictions(output).cpu())

    def targets(self, batch: Any) -> list:
        """Per-unit targets as plain Python objects (read from a CPU batch): the class ids."""
        return batch.y.view(-1)[: self.batch_size(batch)].tolist()

    def score(self, predictions: Sequence, targets: Sequence) -> float:
        raise NotImplementedError

    def constant_baseline(self, train_targets: Sequence, eval_targets: Sequence) -> float:
        """Metric on ``eval_targets`` of the best constant prediction chosen on ``train_targets``: the
        majority class."""
        if not train_targets:
            return float("nan")
        majority = Counter(train_targets).most_common(1)[0][0]
        return self.score([majority] * len(eval_targets), eval_targets)

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
        edges = dict(edge_encoder="none")
        if config.use_edge_attr:
            edges = dict(edge_encoder="embedding", edge_in_dim=max(2, edge_vocab), edge_in_columns=columns)
        return dataclasses.replace(config, node_encoder="code2_ast", head="code2_sequence", num_classes=len(self.vocab),
                                   max_seq_len=self.max_seq_len, **edges)

    def loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        y = batch.y.view(-1, self.max_seq_len)
        return F.cross_entropy(output.float().reshape(-1, output.size(-1)), y.reshape(-1), ignore_index=PAD_TARGET)

    def decode(self, predictions: torch.Tensor) -> list:
        """Each row's subtokens up to the first ``__EOS__``."""
        return [[self.vocab[i] for i in itertools.takewhile(lambda i: i != self.eos, row)] for row in predictions.tolist()]

    def targets(self, batch: Any) -> list:
        return [list(t) for t in batch.y_tokens]  # the original subtokens, also those outside the vocabulary

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
            cand_tp = tp + has[tok]  # per graph: hits among its subtokens, F1 of the set below
            precision, recall = cand_tp / (len(chosen) + 1), cand_tp / np.maximum(lengths, 1)
            denom = np.maximum(precision + recall, 1e-300)  # 0 where both are
            score = float((2 * precision * recall / denom).mean())
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
        edges = dict(edge_encoder="none")
        if config.use_edge_attr and edge_attr is not None:
            edges = dict(edge_encoder="linear", edge_in_dim=int(edge_attr.size(-1)))
        return dataclasses.replace(config, node_encoder=node_encoder, node_in_dim=node_in_dim,
                                   head="graph_classification", num_classes=self.num_classes, **edges)

    def loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.cross_entropy(output.float(), batch.y.view(-1).long(), ignore_index=PAD_TARGET)

    def score(self, predictions: Sequence, targets: Sequence) -> float:
        if not targets:
            return float("nan")
        result = _evaluator("ogbg-ppa").eval(
            {"y_true": np.asarray(targets).reshape(-1, 1), "y_pred": np.asarray(predictions).reshape(-1, 1)}
        )
        return float(result["acc"])

    def state(self) -> dict:
        return {"name": self.name, "num_classes": self.num_classes}


def accuracy_sbm(predictions: Sequence[int], targets: Sequence[int]) -> float:
    """Class-averaged accuracy of benchmarking-gnns (``accuracy_SBM`` of its ``train/metrics.py``, in
    [0, 1]): the mean recall over the classes present in ``targets`` or ``predictions`` (0 for a class
    absent from the targets). Targets ``[0, 0, 0, 1, 1, 2]``, predictions ``[0, 0, 1, 1, 0, 0]``: 7/18."""
    t = np.asarray(targets, dtype=np.int64).reshape(-1)
    p = np.asarray(predictions, dtype=np.int64).reshape(-1)
    if t.size != p.size:
        raise ValueError(f"accuracy_sbm: {p.size} predictions for {t.size} targets")
    if t.size == 0:
        return float("nan")
    classes = np.union1d(t, p)
    size = int(classes.max()) + 1
    count = np.bincount(t, minlength=size)
    hits = np.bincount(t[p == t], minlength=size)
    recall = np.where(count > 0, hits / np.maximum(count, 1), 0.0)
    return float(recall[classes].sum() / len(classes))


class SBMNodeTask(Task):
    """Node classification on PATTERN (2 classes) and CLUSTER (6 classes), as benchmarking-gnns and the
    SAT authors train and score it: node ids through an embedding, no edge features; class-weighted
    cross-entropy (in a batch of ``V`` nodes, class ``c`` of ``n_c`` weighs ``(V - n_c) / V``);
    :func:`accuracy_sbm` over the whole split, so it does not depend on batching or ranks."""

    metric = "acc"
    node_level = True

    def __init__(self) -> None:
        from preprocessing.sbm import NODE_VOCAB, NUM_CLASSES

        self.num_classes = NUM_CLASSES[self.name]
        self.node_vocab = NODE_VOCAB[self.name]

    def configure(self, config: SATConfig, sample: Any) -> SATConfig:
        return dataclasses.replace(config, node_encoder="embedding", node_in_dim=self.node_vocab, edge_encoder="none",
                                   head="node_classification", num_classes=self.num_classes)

    def loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        y = batch.y.view(-1).long()
        real = (y != PAD_TARGET).float()  # padding nodes count in no class (sat.padding)
        counts = torch.zeros(self.num_classes, dtype=torch.float32, device=y.device)
        counts.index_add_(0, y.clamp(min=0), real)
        present = (counts > 0).float()
        total = real.sum().clamp(min=1)
        weight = (total - counts) / total * present
        weight = weight + (weight.sum() == 0).float() * present  # one class only: unweighted, not 0/0
        return F.cross_entropy(output.float(), y, weight=weight, ignore_index=PAD_TARGET)

    def score(self, predictions: Sequence, targets: Sequence) -> float:
        return accuracy_sbm(predictions, targets)


class PatternTask(SBMNodeTask):
    """PATTERN: does the node belong to the planted pattern (2 classes, node inputs 0..2)."""

    name = "pattern"


class ClusterTask(SBMNodeTask):
    """CLUSTER: the node's community (6 classes; input 1 + community on one node per community, else 0)."""

    name = "cluster"


#: task name -> class (``train.task``, the registry's ``task.name``)
TASK_CLASSES: dict[str, type[Task]] = {
    cls.name: cls for cls in (Code2Task, PPATask, PatternTask, ClusterTask)
}


def task_name_for(job_task: Optional[str], data_name: str) -> str:
    """``train.task``, else the task of ``data.name`` (both validated by the job's schema)."""
    return job_task or TASK_BY_DATASET[data_name]


def make_task(name: str, vocab: Optional[Sequence[str]] = None, **state: Any) -> Task:
    """Build a task by name (``state``: what :meth:`Task.state` returned, minus the name)."""
    state.pop("name", None)
    if name == "code2":
        return Code2Task(vocab or [], **state)
    if name not in TASK_CLASSES:
        raise ValueError(f"unknown task {name!r}; expected one of {list(TASK_CLASSES)}")
    return TASK_CLASSES[name](**state)
