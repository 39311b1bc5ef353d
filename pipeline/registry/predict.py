"""Prediction from the MLflow model registry: ``satp predict`` and the Python API.

>>> model = load("models:/sat-code2@champion", tracking_uri="sqlite:////abs/runs/mlflow.db")
>>> model.predict(open("some_module.py").read())     # code2: a FunctionPrediction per function
>>> model.predict_file("graphs.json")               # a JSON graph file, a shard directory, a .py file

A registered model carries under ``input`` what building its inputs needs (:func:`input_spec`);
inputs are featurised exactly as training data (:func:`preprocessing.reader.featurise`). Errors are
one-line ``ValueError`` / ``OSError``."""
from __future__ import annotations

import ast
import dataclasses
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch

from pipeline.registry import json_graphs as jg
from pipeline.registry.limits import UNLIMITED, Budget

BATCH_GRAPHS = 32
#: nodes of one model batch (a larger graph goes alone): what a request's deadline waits for at most
BATCH_NODES = 8192
JSON_TASKS = ("ppa", "pattern", "cluster")  # the tasks whose inputs are JSON graphs (see Predictor.graphs_from_json)


# ----------------------------------------------------------------------------- what a model carries
def input_spec(shard_dir: str | Path, storage=None) -> dict[str, Any]:
    """``{"input": {...}}`` to log with a model trained on ``shard_dir``: the shards' task and transform
    and, for code2, the dataset's node-type / attribute tables (in id order)."""
    from preprocessing.shards import read_manifest

    manifest = read_manifest(shard_dir, storage)
    spec: dict[str, Any] = {
        "task": manifest.get("task"),
        "dataset": manifest.get("dataset"),
        "transform": (manifest.get("config") or {}).get("transform"),
        "config_hash": manifest.get("config_hash"),
    }
    if manifest.get("task") == "code2":
        folder = Path((manifest.get("source") or {}).get("folder", ""))
        types, attrs = _mapping_tables(folder)
        if types is not None:
            spec["node_types"], spec["node_attributes"] = types, attrs
    return {"input": spec}


def _mapping_tables(folder: Path) -> tuple[Optional[list[str]], Optional[list[str]]]:
    from preprocessing.python_graphs import load_mappings

    if not (folder / "mapping" / "typeidx2type.csv.gz").is_file():
        return None, None
    type2idx, attr2idx = load_mappings(folder)
    return _ordered(type2idx), _ordered(attr2idx)


def _ordered(index: dict[str, int]) -> list[str]:
    out = [""] * (max(index.values()) + 1 if index else 0)
    for key, i in index.items():
        out[i] = key
    return out


# ----------------------------------------------------------------------------- predictions
@dataclasses.dataclass
class FunctionPrediction:
    """One function of a Python source: where it is, its actual name and the predicted subtokens."""

    name: str
    line: int
    actual: list[str]
    predicted: list[str]


class Predictor:
    """A registered SAT model ready to predict (node tasks: a class per node, a list per graph)."""

    def __init__(self, loaded, uri: str = "") -> None:
        self.uri = uri
        self.model = loaded.model.eval()
        self.task = loaded.task
        self.model_config = loaded.model_config
        self.vocab = loaded.vocab
        self.info = loaded.info
        self._spec = self.info.get("input") or {}

    @property
    def task_name(self) -> str:
        return self.task.name

    def _transform(self):
        from preprocessing.config import TransformConfig

        if not self._spec.get("transform"):
            raise ValueError(f"{self.uri}: the model does not record its transform config; cannot build inputs")
        return TransformConfig.model_validate(self._spec["transform"])

    # -- graphs -> predictions
    @torch.no_grad()
    def predict_graphs(self, graphs: Sequence[Any], budget: Budget = UNLIMITED) -> list:
        """Per-graph predictions for ``SATData`` graphs (node tasks: a list per graph); ``budget``: a served
        request's deadline, checked before each batch."""
        from torch_geometric.data import Batch

        out: list = []
        for chunk in _batches(list(graphs)):
            budget.check_time()
            predictions = self.task.predict(self.model(Batch.from_data_list(chunk)))
            if self.task.node_level:  # one flat list over the batch's nodes -> one list per graph
                ends = np.cumsum([g.num_nodes for g in chunk])
                predictions = [predictions[a:b] for a, b in zip(np.r_[0, ends[:-1]], ends)]
            out.extend(predictions)
        return out

    @torch.no_grad()
    def outputs(self, graphs: Sequence[Any]) -> torch.Tensor:
        """The model's raw outputs (logits) for ``graphs``, concatenated over batches."""
        from torch_geometric.data import Batch

        return torch.cat([self.model(Batch.from_data_list(chunk)) for chunk in _batches(list(graphs))], 0)

    def predict(self, inputs: Any) -> list:
        """``inputs``: Python source text (code2: a :class:`FunctionPrediction` per function), or
        ``SATData`` graphs / one graph (per-graph predictions)."""
        if isinstance(inputs, str):
            return self.predict_source(inputs)
        if hasattr(inputs, "edge_index"):
            inputs = [inputs]
        return self.predict_graphs(inputs)

    def predict_json(self, values: list[dict], where: str, budget: Budget) -> list:
        """Predictions for the pyfunc's JSON inputs: ``{"source": text}`` for code2, else JSON graphs.
        ``budget``: a served request's caps (checked on the whole request first) and deadline."""
        if self.task_name != "code2":
            return self.predict_graphs(self.graphs_from_json(values, where, budget)[0], budget)
        for i, value in enumerate(values):
            if not isinstance(value.get("source"), str):
                raise ValueError(f"{where} {i}: a code2 model takes {{'source': Python source text}}")
            budget.source(value["source"], f"{where} {i}")
        parsed = []
        for i, value in enumerate(values):
            budget.check_time()
            parsed.append(self._functions(value["source"], f"<{where} {i}>"))
        for i, functions in enumerate(parsed):
            for fn, nodes in functions:
                budget.graph(nodes, f"{where} {i}: function {fn.name} (line {fn.lineno})")
        return [[dataclasses.asdict(p) for p in self._predict_functions(functions, budget)] for functions in parsed]

    # -- Python source (code2)
    def _require(self, tasks: Sequence[str], what: str) -> None:
        if self.task_name not in tasks:
            names = ", ".join(tasks[:-1]) + (" or " if len(tasks) > 1 else "") + tasks[-1]
            raise ValueError(f"{self.uri or 'the model'} is a {self.task_name} model; {what} needs a {names} model")

    def source_graphs(self, text: str, filename: str = "<source>") -> list[tuple[str, int, list[str], Any]]:
        """``(name, line, actual subtokens, SATData)`` for every function of ``text`` (source order)."""
        return self._function_graphs(self._functions(text, filename))

    def predict_source(self, text: str, filename: str = "<source>") -> list[FunctionPrediction]:
        return self._predict_functions(self._functions(text, filename))

    def _functions(self, text: str, filename: str) -> list[tuple[ast.AST, int]]:
        """The functions of ``text`` (source order, nested ones included, as pycode does), each with the
        number of nodes of its graph: known before any graph is built, in one pass over the tree."""
        self._require(("code2",), "Python source")
        if "node_types" not in self._spec:
            raise ValueError(f"{self.uri}: the model does not carry its node-type tables; cannot featurise source")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tree = ast.parse(text, filename=filename)
        except SyntaxError as exc:
            raise ValueError(f"{filename}:{exc.lineno or 0}: not valid Python ({exc.msg})") from None
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"{filename}: not valid Python ({str(exc).splitlines()[0]})") from None
        order: list[ast.AST] = []
        stack: list[ast.AST] = [tree]
        while stack:  # pre-order
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(list(ast.iter_child_nodes(node))))
        sizes: dict[int, int] = {}  # by id: the parser shares its Load/Store leaves, of size 1 wherever they are
        for node in reversed(order):
            sizes[id(node)] = 1 + sum(sizes[id(child)] for child in ast.iter_child_nodes(node))
        # a function's graph is the Module holding it and its subtree (preprocessing.python_graphs.function_graph)
        return [(node, 1 + sizes[id(node)]) for node in order if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]

    def _function_graphs(self, functions: list[tuple[ast.AST, int]],
                         budget: Budget = UNLIMITED) -> list[tuple[str, int, list[str], Any]]:
        from preprocessing.python_graphs import code_to_raw_graph

        type2idx = {t: i for i, t in enumerate(self._spec["node_types"])}
        attr2idx = {a: i for i, a in enumerate(self._spec["node_attributes"])}
        raws = []
        for i, (fn, _) in enumerate(functions):
            budget.check_time()
            raw = code_to_raw_graph(fn, type2idx, attr2idx)
            raw["graph_id"] = i
            raws.append(raw)
        data = self._featurise(raws, "code2", budget)
        return [(fn.name, fn.lineno, list(raw["y_tokens"]), d) for (fn, _), raw, d in zip(functions, raws, data)]

    def _predict_functions(self, functions: list[tuple[ast.AST, int]],
                           budget: Budget = UNLIMITED) -> list[FunctionPrediction]:
        items = self._function_graphs(functions, budget)
        preds = self.predict_graphs([d for *_, d in items], budget) if items else []
        return [FunctionPrediction(name, line, actual, list(p)) for (name, line, actual, _), p in zip(items, preds)]

    def _featurise(self, raws: list[dict], task: str, budget: Budget = UNLIMITED) -> list:
        """Raw graphs -> ``SATData`` by the path training data took (:func:`preprocessing.reader.featurise`)."""
        from preprocessing.reader import featurise

        if not raws:
            return []
        return featurise(raws, task, self._transform(), self.vocab, budget.check_time)

    # -- graph files and shards
    def graphs_from_file(self, path: str | Path, split: str = "test") -> tuple[list[Any], list[str]]:
        """``(graphs, labels)`` from a shard directory (``split``), or a JSON graph file."""
        path = Path(path)
        if path.is_dir():
            return self._from_shards(path, split)
        if path.suffix == ".json":
            return self.graphs_from_json(jg.read_json_graphs(path), str(path))
        raise ValueError(f"{path}: expected a Python file (code2), a shard directory or a JSON graph file")

    def _from_shards(self, directory: Path, split: str) -> tuple[list[Any], list[str]]:
        from preprocessing.reader import ShardDataset

        ds = ShardDataset(directory, split)
        task = ds.manifest.get("task")
        if task != self.task_name:
            raise ValueError(f"{directory}: {task} shards; {self.uri or 'the model'} is a {self.task_name} model")
        want = (self._spec.get("transform") or {})
        have = ((ds.manifest.get("config") or {}).get("transform") or {})
        if want and have and want != have:
            keys = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
            raise ValueError(f"{directory}: built with another transform than the model's (differs in {keys})")
        ids = ds.graph_ids
        return [ds[i] for i in range(len(ds))], [f"{split}[{i}] graph {int(g)}" for i, g in enumerate(ids)]

    def graphs_from_json(self, values: list, where: str, budget: Budget = UNLIMITED) -> tuple[list[Any], list[str]]:
        """``(graphs, labels)`` of JSON graphs (:mod:`pipeline.registry.json_graphs`; ``where``: named in
        errors; undirected edges, listed once or both ways). ``budget``: every graph's ``num_nodes`` is
        checked against its caps before any graph is built."""
        self._require(JSON_TASKS, f"{where} (JSON graphs)")
        if not values:
            raise ValueError(f"{where}: no graphs (an empty list)")
        for i, g in enumerate(values):
            budget.graph(jg.num_nodes(g, f"{where}: graph {i}"), f"{where}: graph {i}")
        raws = []
        for i, g in enumerate(values):
            at = f"{where}: graph {i}"
            n = jg.num_nodes(g, at)
            ei = jg.edge_index(g, n, at)
            if self.task.node_level:  # undirected, once per pair (the SBM raw layout), no self-loops
                x = jg.node_inputs(g, n, self.model_config.node_in_dim, self.task_name, at)
                pairs = np.unique(np.sort(ei.T, axis=1), axis=0)
                pairs = pairs[pairs[:, 0] != pairs[:, 1]].T  # [2, E] with u < v
                raws.append({"graph_id": i, "num_nodes": n, "edge_index": np.concatenate([pairs, pairs[::-1]], 1),
                             "x": x, "node_label": np.zeros(n, dtype=np.int64)})
            else:  # one direction per undirected edge, and the reverse added (OGB's layout)
                ea = jg.edge_features(g, ei.shape[1], self.model_config.edge_in_dim, at)
                raws.append({"graph_id": i, "num_nodes": n, "edge_index": np.concatenate([ei, ei[::-1]], 1),
                             "edge_attr": np.concatenate([ea, ea], 0), "y": 0})
        return self._featurise(raws, self.task_name, budget), [f"graph {i}" for i in range(len(raws))]

    def predict_file(self, path: str | Path, split: str = "test") -> list:
        """A Python file (code2: :class:`FunctionPrediction` per function), or graphs from a shard
        directory / JSON graph file (``(label, prediction)`` pairs)."""
        path = Path(path)
        if not path.exists():
            raise ValueError(f"{path}: no such file")
        if path.suffix == ".py" or (path.is_file() and self.task_name == "code2" and path.suffix != ".json"):
            self._require(("code2",), f"{path} (Python source)")
            import tokenize

            try:
                with tokenize.open(path) as fh:
                    text = fh.read()
            except (SyntaxError, UnicodeDecodeError) as exc:
                raise ValueError(f"{path}: not valid Python ({str(exc).splitlines()[0]})") from None
            return self.predict_source(text, str(path))
        graphs, labels = self.graphs_from_file(path, split)
        return list(zip(labels, self.predict_graphs(graphs)))


def _batches(graphs: list) -> list[list]:
    """``graphs`` in order, as model batches of at most :data:`BATCH_GRAPHS` graphs and
    :data:`BATCH_NODES` nodes (a larger graph alone)."""
    batches: list[list] = []
    nodes = 0
    for g in graphs:
        if not batches or len(batches[-1]) == BATCH_GRAPHS or nodes + g.num_nodes > BATCH_NODES:
            batches.append([])
            nodes = 0
        batches[-1].append(g)
        nodes += g.num_nodes
    return batches


def load(uri: str, tracking_uri: Optional[str] = None) -> Predictor:
    """Load ``models:/NAME@alias``, ``models:/NAME/VERSION`` or ``runs:/ID/model`` (``tracking_uri``:
    default ``$MLFLOW_TRACKING_URI`` or the project's SQLite store); errors in one line."""
    from pipeline.registry.addresses import check_model_uri, check_reachable, resolve_tracking_uri
    from pipeline.registry.versions import load_model

    check_model_uri(uri)
    tracking = resolve_tracking_uri(tracking_uri)
    check_reachable(tracking)
    try:
        loaded = load_model(uri, tracking_uri=tracking)
    except ValueError as exc:
        raise ValueError(_short(str(exc), uri)) from None
    except Exception as exc:  # MLflow's REST client: connection errors, timeouts
        from mlflow.exceptions import MlflowException

        if isinstance(exc, (MlflowException, OSError)) or "Connection" in type(exc).__name__:
            raise OSError(f"{uri}: tracking store {tracking}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        raise
    return Predictor(loaded, uri)


def _short(message: str, uri: str) -> str:
    first = message.splitlines()[0] if message else ""
    lowered = first.lower()
    if "not found" in lowered or "does not exist" in lowered or "resource_does_not_exist" in lowered:
        return f"{uri}: no such registered model or alias ({first.removeprefix(uri + ': ')})"
    return first


def format_predictions(predictions: list) -> str:
    lines = []
    for p in predictions:
        if isinstance(p, FunctionPrediction):
            lines.append(f"{p.line:>5}  {p.name:<32} -> {' '.join(p.predicted) or '(nothing)'}")
        else:
            label, pred = p
            if isinstance(pred, list):  # node task: one class per node
                lines.append(f"{label}: node classes {' '.join(str(c) for c in pred)}")
            else:
                lines.append(f"{label}: class {pred}")
    return "\n".join(lines)
