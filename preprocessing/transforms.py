"""Per-graph transforms, vectorised with numpy / scipy sparse (no Python loop over nodes).

A raw graph is a dict of numpy arrays (see :mod:`preprocessing.sources`); :func:`transform_graph`
turns it into the dict of arrays stored in one shard row (see :mod:`preprocessing.shards`).

- code2 (OGB's example ``examples/graphproppred/code2``): ``augment_edge`` (reverse AST edges with
  ``edge_attr`` [0, 1], next-token edges between attributed nodes in DFS order [1, 0] and their
  reverse [1, 1], AST edges [0, 0]); targets encoded to ``max_seq_len`` ids as the example's
  ``encode_y_to_arr`` (vocabulary id or ``__UNK__``, padded with ``__EOS__``); ``node_depth``.
- ppa: ``x`` zeros ``[N, 1]`` or the summed incident edge features ``[N, 7]``.
- RWPE (:func:`random_walk_pe`, equal to :func:`sat.encodings.random_walk_pe` to float32
  rounding, ~10x faster on tree-like graphs), optional Laplacian PE
  (:func:`sat.encodings.laplacian_pe`), k-hop subgraph indices
  (:func:`sat.data.k_hop_subgraph_indices`) and in-degrees (:func:`sat.encodings.node_degree`).
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

import numpy as np
import scipy.sparse as sp
import torch

from sat.data import k_hop_subgraph_indices
from sat.encodings import laplacian_pe, node_degree

UNK = "__UNK__"
EOS = "__EOS__"


# --------------------------------------------------------------------------- code2 targets
def build_vocab(token_lists: Iterable[Sequence[str]], vocab_size: int) -> list[str]:
    """OGB's ``get_vocab_mapping``: the ``vocab_size`` most frequent subtokens (ties by first
    appearance), then ``__UNK__`` and ``__EOS__``. Clamped when fewer distinct subtokens exist."""
    counts: Counter[str] = Counter()
    for tokens in token_lists:
        counts.update(tokens)  # Counter keeps first-appearance order for equal counts
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])  # stable sort = OGB's argsort(kind=stable)
    vocab = [w for w, _ in ranked[:vocab_size] if w not in (UNK, EOS)]
    return vocab + [UNK, EOS]


def encode_targets(tokens: Sequence[str], vocab_index: dict[str, int], max_seq_len: int) -> np.ndarray:
    """OGB's ``encode_seq_to_arr``: ``[max_seq_len]`` ids, UNK for unknown, EOS-padded."""
    unk, eos = vocab_index[UNK], vocab_index[EOS]
    ids = [vocab_index.get(w, unk) for w in list(tokens)[:max_seq_len]]
    ids += [eos] * (max_seq_len - len(ids))
    return np.asarray(ids, dtype=np.int64)


# --------------------------------------------------------------------------- code2 edges
def augment_edge(edge_index: np.ndarray, node_is_attributed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """OGB's code2 ``augment_edge`` on numpy arrays: returns ``(edge_index [2, E'], edge_attr [E', 2])``.

    The order of the edges and attributes is the example's: AST edges, their reverse, next-token
    edges, their reverse.
    """
    ast_e = edge_index.astype(np.int64, copy=False)
    attributed = np.flatnonzero(node_is_attributed.reshape(-1) == 1)
    nxt = np.stack([attributed[:-1], attributed[1:]])
    e_ast, e_next = ast_e.shape[1], nxt.shape[1]
    new_index = np.concatenate([ast_e, ast_e[::-1], nxt, nxt[::-1]], axis=1)
    attr = np.zeros((2 * e_ast + 2 * e_next, 2), dtype=np.int64)
    attr[e_ast : 2 * e_ast, 1] = 1
    attr[2 * e_ast : 2 * e_ast + e_next, 0] = 1
    attr[2 * e_ast + e_next :, :] = 1
    return new_index, attr


# --------------------------------------------------------------------------- encodings
def random_walk_pe(edge_index: np.ndarray, num_nodes: int, steps: int) -> np.ndarray:
    """RWPE ``[(D^-1 A)^p]_ii`` for ``p = 1..steps`` as ``[N, steps]`` float32.

    Same definition as :func:`sat.encodings.random_walk_pe` (undirected, no self-loops,
    isolated nodes 0). ``(D^-1 A)^p`` has the diagonal of the symmetric
    ``S^p = (D^-1/2 A D^-1/2)^p``; the powers ``S^1..S^h`` (``h = ceil(steps / 2)``) are built by
    sparse-dense products (cost ``nnz * N`` each, not ``N^3``), and as ``S`` is symmetric
    ``diag(S^(2a)) = rowsum(S^a * S^a)`` and ``diag(S^(2a-1)) = rowsum(S^(a-1) * S^a)``: two
    dense ``N x N`` powers in memory at a time.
    """
    n = int(num_nodes)
    out = np.zeros((n, steps), dtype=np.float32)
    if n == 0 or steps == 0:
        return out
    e = edge_index.astype(np.int64, copy=False)
    keep = e[0] != e[1]
    a, b = e[0][keep], e[1][keep]
    key = np.unique(np.concatenate([a * n + b, b * n + a]))  # undirected, duplicates collapsed
    rows, cols = key // n, key % n
    deg = np.bincount(rows, minlength=n)
    inv_sqrt = np.zeros(n, dtype=np.float32)
    np.divide(1.0, np.sqrt(deg.astype(np.float32)), out=inv_sqrt, where=deg > 0)
    indptr = np.concatenate([[0], np.cumsum(deg)])
    sym = sp.csr_matrix((inv_sqrt[rows] * inv_sqrt[cols], cols, indptr), shape=(n, n))
    # diag(S^(2a)) = rowsum(S^a * S^a), diag(S^(2a-1)) = rowsum(S^(a-1) * S^a); diag(S) = 0
    prev, cur = None, sym.toarray()
    for power in range(1, (steps + 1) // 2 + 1):
        if power > 1:
            prev, cur = cur, np.asarray(sym @ cur)
            out[:, 2 * power - 2] = np.einsum("ij,ij->i", prev, cur)
        if 2 * power <= steps:
            out[:, 2 * power - 1] = np.einsum("ij,ij->i", cur, cur)
    return out


# --------------------------------------------------------------------------- one graph
def transform_graph(graph: dict, task: str, cfg, vocab_index: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """Transform one raw graph into the arrays of one shard row.

    Args:
        graph: raw arrays: ``graph_id``, ``num_nodes``, ``edge_index`` [2, E] (local ids);
            code2: ``x`` [N, 2], ``node_depth`` [N], ``node_is_attributed`` [N], ``y_tokens``;
            ppa: ``edge_attr`` [E, 7] float32, ``y`` int.
        task: ``code2`` or ``ppa``.
        cfg: :class:`preprocessing.config.TransformConfig`.
        vocab_index: code2 only: subtoken -> id.

    Returns:
        column name -> numpy array (shapes as in :mod:`preprocessing.shards`).
    """
    n = int(graph["num_nodes"])
    out: dict[str, np.ndarray] = {"graph_id": np.int64(graph["graph_id"]), "num_nodes": np.int64(n)}
    if task == "code2":
        edge_index = graph["edge_index"].astype(np.int64, copy=False)
        if cfg.augment_edge:
            edge_index, edge_attr = augment_edge(edge_index, graph["node_is_attributed"])
            out["edge_attr"] = edge_attr.astype(np.int8)
        out["x"] = graph["x"].astype(np.int64, copy=False)
        out["node_depth"] = graph["node_depth"].reshape(-1).astype(np.int64, copy=False)
        out["y"] = encode_targets(graph["y_tokens"], vocab_index, cfg.max_seq_len)
        out["y_tokens"] = list(graph["y_tokens"])
    elif task == "ppa":
        edge_index = graph["edge_index"].astype(np.int64, copy=False)
        edge_attr = graph["edge_attr"].astype(np.float32, copy=False)
        out["edge_attr"] = edge_attr
        if cfg.ppa_node_input == "edge_sum":
            x = np.zeros((n, edge_attr.shape[1]), dtype=np.float32)
            np.add.at(x, edge_index[1], edge_attr)
            out["x"] = x
        else:
            out["x"] = np.zeros((n, 1), dtype=np.int64)
        out["y"] = np.asarray([graph["y"]], dtype=np.int64)
    else:
        raise ValueError(f"unknown task {task!r}")
    out["edge_index"] = edge_index
    ei_t = torch.from_numpy(edge_index)
    out["degree"] = node_degree(ei_t, n).numpy()
    if cfg.rwpe_steps:
        out["rwpe"] = random_walk_pe(edge_index, n, cfg.rwpe_steps)
    if cfg.lap_pe_dim:
        out["lap_pe"] = laplacian_pe(ei_t, n, cfg.lap_pe_dim).numpy()
    if cfg.k_hops:
        sub = k_hop_subgraph_indices(ei_t, n, cfg.k_hops)
        out["subgraph_node_index"] = sub["subgraph_node_index"].numpy()
        out["subgraph_size"] = np.bincount(sub["subgraph_indicator"].numpy(), minlength=n).astype(np.int64)
        out["subgraph_edge_index"] = sub["subgraph_edge_index"].numpy()
        out["subgraph_edge_id"] = sub["subgraph_edge_id"].numpy()
    return out
