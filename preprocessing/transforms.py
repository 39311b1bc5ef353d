"""Per-graph transforms, vectorised with numpy / scipy sparse: a raw graph (:mod:`preprocessing.sources`)
into the arrays of one shard row (:mod:`preprocessing.shards`).

code2 follows OGB's example (``augment_edge``, ``encode_y_to_arr``, ``node_depth``); ppa's ``x`` is
zeros ``[N, 1]`` or the summed incident edge features ``[N, 7]``; pattern / cluster carry node
input ids ``[N, 1]`` and node classes ``[N]``. Then RWPE, Laplacian PE, k-hop subgraph indices and
in-degrees (:mod:`sat.encodings`, :mod:`sat.data`)."""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

import numpy as np
import torch

from preprocessing.config import SBM_DATASETS
from sat.data import k_hop_subgraph_indices
from sat.encodings import incident_edge_sum, laplacian_pe, node_degree, random_walk_pe

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
    """OGB's code2 ``augment_edge``: ``(edge_index [2, E'], edge_attr [E', 2])`` in the example's order
    (AST edges, their reverse, next-token edges, their reverse)."""
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


# --------------------------------------------------------------------------- one graph
def transform_graph(graph: dict, task: str, cfg, vocab_index: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """One raw graph (``graph_id``, ``num_nodes``, ``edge_index [2, E]`` and the task's arrays) -> the
    arrays of one shard row (shapes as in :mod:`preprocessing.shards`). ``vocab_index``: code2's
    subtoken -> id."""
    n = int(graph["num_nodes"])
    out: dict[str, np.ndarray] = {"graph_id": np.int64(graph["graph_id"]), "num_nodes": np.int64(n)}
    edge_index = graph["edge_index"].astype(np.int64, copy=False)
    if task == "code2":
        if cfg.augment_edge:
            edge_index, edge_attr = augment_edge(edge_index, graph["node_is_attributed"])
            out["edge_attr"] = edge_attr.astype(np.int8)
        out["x"] = graph["x"].astype(np.int64, copy=False)
        out["node_depth"] = graph["node_depth"].reshape(-1).astype(np.int64, copy=False)
        out["y"] = encode_targets(graph["y_tokens"], vocab_index, cfg.max_seq_len)
        out["y_tokens"] = list(graph["y_tokens"])
    elif task == "ppa":
        edge_attr = graph["edge_attr"].astype(np.float32, copy=False)
        out["edge_attr"] = edge_attr
        if cfg.ppa_node_input == "edge_sum":
            out["x"] = incident_edge_sum(torch.from_numpy(edge_index), torch.from_numpy(edge_attr), n).numpy()
        else:
            out["x"] = np.zeros((n, 1), dtype=np.int64)
        out["y"] = np.asarray([graph["y"]], dtype=np.int64)
    elif task in SBM_DATASETS:
        out["x"] = graph["x"].reshape(-1, 1).astype(np.int64, copy=False)
        out["y"] = graph["node_label"].reshape(-1).astype(np.int64, copy=False)
    else:
        raise ValueError(f"unknown task {task!r}")
    out["edge_index"] = edge_index
    ei_t = torch.from_numpy(edge_index)
    out["degree"] = node_degree(ei_t, n).numpy()
    if cfg.rwpe_steps:
        out["rwpe"] = random_walk_pe(ei_t, n, cfg.rwpe_steps).numpy()
    if cfg.lap_pe_dim:
        out["lap_pe"] = laplacian_pe(ei_t, n, cfg.lap_pe_dim).numpy()
    if cfg.k_hops:
        sub = k_hop_subgraph_indices(ei_t, n, cfg.k_hops)
        out["subgraph_node_index"] = sub["subgraph_node_index"].numpy()
        out["subgraph_size"] = np.bincount(sub["subgraph_indicator"].numpy(), minlength=n).astype(np.int64)
        out["subgraph_edge_index"] = sub["subgraph_edge_index"].numpy()
        out["subgraph_edge_id"] = sub["subgraph_edge_id"].numpy()
    return out
