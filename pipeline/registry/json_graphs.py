"""JSON graphs (``satp predict MODEL graphs.json``, the pyfunc's inputs), read and checked: a graph is
``{"num_nodes": N, "edge_index": [[src...], [dst...]]}`` with ``edge_attr`` (ppa: ``[E, 7]``) or ``x``
(pattern, cluster: ``[N]`` node input ids); a bad value is one line naming the file and graph."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def read_json_graphs(path: Path) -> list:
    """The graphs of a JSON graph file (one graph or a list of them)."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a JSON graph file (not UTF-8 text: byte {exc.start} is "
                         f"0x{exc.object[exc.start]:02x})") from None
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    return values if isinstance(values, list) else [values]


def num_nodes(g, at: str) -> int:
    """``num_nodes``: a positive integer (``at``: ``FILE: graph I``, named in errors)."""
    if not isinstance(g, dict):
        raise ValueError(f"{at}: expected an object with num_nodes and edge_index, got {type(g).__name__}")
    n = g.get("num_nodes")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{at}: num_nodes {n!r}; expected a positive integer (graphs have nodes)")
    return n


def integers(value, key: str, at: str, rows: int | None = None) -> np.ndarray:
    """``value`` as int64, ``[rows, K]`` (``rows`` given) or ``[K]``: nested JSON lists of integers only
    (a float such as ``1.5`` or ``1.0``, a boolean, a string is refused, never cast)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        elif isinstance(item, bool) or not isinstance(item, int):
            raise ValueError(f"{at}: {key} holds {item!r}; expected integer ids")
    try:
        arr = np.asarray(value, dtype=np.int64)
    except ValueError:  # ragged lists
        arr = None
    if rows is not None and arr is not None and arr.size == 0:
        arr = arr.reshape(rows, 0)
    if arr is None or arr.ndim != (1 if rows is None else 2) or (rows is not None and arr.shape[0] != rows):
        shape = "ragged lists" if arr is None else list(arr.shape)
        expected = "[N]" if rows is None else f"[{rows}, E]"
        raise ValueError(f"{at}: {key} has shape {shape}; expected {expected}")
    return arr


def edge_index(g, n: int, at: str) -> np.ndarray:
    """``edge_index`` ``[2, E]``: integers in ``[0, num_nodes)``."""
    ei = integers(g.get("edge_index", [[], []]), "edge_index", at, rows=2)
    if ei.size and (ei.min() < 0 or ei.max() >= n):
        bad = int(ei.min() if ei.min() < 0 else ei.max())
        raise ValueError(f"{at}: edge_index holds node {bad}, outside [0, {n}) (num_nodes {n})")
    return ei


def edge_features(g, edges: int, width: int, at: str) -> np.ndarray:
    """``edge_attr`` ``[E, width]``: finite numbers, one row per edge."""
    try:
        ea = np.asarray(g.get("edge_attr"), dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{at}: edge_attr must be [E, {width}] numbers") from None
    if ea.shape != (edges, width):
        raise ValueError(f"{at}: edge_attr has shape {list(ea.shape)}; expected [{edges}, {width}] (one row per edge)")
    if not np.isfinite(ea).all():
        raise ValueError(f"{at}: edge_attr holds NaN or infinite values")
    return ea.astype(np.float32)


def node_inputs(g, n: int, vocab: int, task: str, at: str) -> np.ndarray:
    """``x`` ``[N]``: node input ids in ``[0, vocab)``."""
    x = integers(g.get("x"), "x", at) if g.get("x") is not None else None
    if x is None or x.size != n:
        raise ValueError(f"{at}: x has {0 if x is None else x.size} entries for {n} nodes")
    if x.min() < 0 or x.max() >= vocab:
        raise ValueError(f"{at}: x holds {int(x.min() if x.min() < 0 else x.max())}, outside [0, {vocab}) "
                         f"({task} node inputs)")
    return x
