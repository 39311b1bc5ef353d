"""Python functions -> ogbg-code2 graphs, by the rules of OGB's ``code2/py2graph.py``.

Each function definition (nested ones too) is parsed on its own; every AST object is a node in DFS
pre-order, edges parent -> child; a node's attribute is the first non-None of ``name, arg, s, n,
id, attr``; depth = ancestors; the function's own name is masked (``_mask_``); the label is its
name split into lower-case subtokens. New code is featurised by the same rules with a built
dataset's tables (:func:`load_mappings`, :func:`code_to_raw_graph`)."""
from __future__ import annotations

import ast
import csv
import gzip
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MASK = "_mask_"
_SUBTOKEN = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+")


def split_name(name: str) -> list[str]:
    """``getHTTPResponse_code2`` -> ``['get', 'http', 'response', 'code', '2']``."""
    return [t.lower() for part in name.split("_") for t in _SUBTOKEN.findall(part)]


def _attribute(node: ast.AST) -> str | None:
    for key in ("name", "arg", "s", "n", "id", "attr"):
        if key in ("s", "n"):
            if not isinstance(node, ast.Constant):
                continue
            value = node.value
        else:
            value = getattr(node, key, None)
        if value is not None:
            text = str(value)
            return text.encode("utf-8", errors="surrogatepass").decode("utf-8", errors="replace")
    return None


@dataclass
class FunctionGraph:
    types: list[str]
    attrs: list[str | None]
    depth: list[int]
    parent: list[int]  # parent of node i (i >= 1), -1 for the root
    label: list[str]


def function_graph(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> FunctionGraph:
    """The code2 graph of one function definition (see the module docstring)."""
    root = ast.Module(body=[fn], type_ignores=[])
    types: list[str] = []
    attrs: list[str | None] = []
    depth: list[int] = []
    parent: list[int] = []
    stack: list[tuple[ast.AST, int, int]] = [(root, -1, 0)]
    while stack:
        node, par, d = stack.pop()
        me = len(types)
        types.append(type(node).__name__)
        attrs.append(_attribute(node))
        depth.append(d)
        parent.append(par)
        children: list[ast.AST] = []
        for _, value in ast.iter_fields(node):
            if isinstance(value, list):
                children.extend(item for item in value if isinstance(item, ast.AST))
            elif isinstance(value, ast.AST):
                children.append(value)
        stack.extend((child, me, d + 1) for child in reversed(children))
    name = fn.name
    for i, t in enumerate(types):
        if "FunctionDef" in t and attrs[i] == name:
            attrs[i] = MASK
    return FunctionGraph(types, attrs, depth, parent, split_name(name))


def load_mappings(folder: str | Path) -> tuple[dict[str, int], dict[str, int]]:
    """``(type2idx, attr2idx)`` from a code2 folder's ``mapping/`` (to featurise new code)."""
    out = []
    for fname in ("typeidx2type.csv.gz", "attridx2attr.csv.gz"):
        with gzip.open(Path(folder) / "mapping" / fname, "rt", encoding="utf-8", newline="") as fh:
            rows = list(csv.reader(fh))[1:]
        out.append({value: int(idx) for idx, value in rows})
    return out[0], out[1]


def code_to_raw_graph(fn: ast.FunctionDef | ast.AsyncFunctionDef, type2idx: dict[str, int],
                      attr2idx: dict[str, int]) -> dict[str, np.ndarray]:
    """One function as the raw arrays :func:`preprocessing.transforms.transform_graph` takes
    (``y_tokens`` is the true name's subtokens), using a dataset's mappings."""
    g = function_graph(fn)
    unk_t, unk_a, none_a = type2idx["__UNK__"], attr2idx["__UNK__"], attr2idx["__NONE__"]
    n = len(g.types)
    return {
        "graph_id": 0,
        "num_nodes": n,
        "edge_index": np.asarray([[g.parent[i] for i in range(1, n)], list(range(1, n))], dtype=np.int64).reshape(2, -1),
        "x": np.asarray(
            [(type2idx.get(t, unk_t), none_a if a is None else attr2idx.get(a, unk_a)) for t, a in zip(g.types, g.attrs)],
            dtype=np.int64,
        ),
        "node_depth": np.asarray(g.depth, dtype=np.int64),
        "node_is_attributed": np.asarray([int(a is not None) for a in g.attrs], dtype=np.int64),
        "y_tokens": g.label,
    }
