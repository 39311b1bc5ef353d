"""Per-graph structural encodings, precomputed once per graph (Chen et al., ICML 2022, Sec. 3.3).

The absolute encodings SAT adds to the node inputs, RWPE (Dwivedi et al., 2022) and Laplacian
eigenvectors (Dwivedi & Bresson, 2021), from one graph's ``edge_index [2, E]`` as float32 tensors,
vectorised with sparse matrices for the preprocessing stage.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch


RWPE_BLOCK = 1024  # columns of the return probabilities computed at once: O(N * block) memory


def _normalised_adjacency(edge_index: torch.Tensor, n: int, dtype: type) -> sp.csr_matrix:
    """``D^-1/2 A D^-1/2`` of the undirected graph (self-loops dropped, duplicate edges collapsed)."""
    e = edge_index.detach().cpu().numpy().astype(np.int64, copy=False)
    keep = e[0] != e[1]
    a, b = e[0][keep], e[1][keep]
    key = np.unique(np.concatenate([a * n + b, b * n + a]))  # sorted row * n + col: the CSR order
    rows, cols = key // n, key % n
    deg = np.bincount(rows, minlength=n)
    inv_sqrt = np.zeros(n, dtype=dtype)
    np.divide(1.0, np.sqrt(deg.astype(dtype)), out=inv_sqrt, where=deg > 0)
    indptr = np.concatenate([[0], np.cumsum(deg)])
    return sp.csr_matrix((inv_sqrt[rows] * inv_sqrt[cols], cols, indptr), shape=(n, n))


def random_walk_pe(edge_index: torch.Tensor, num_nodes: int, steps: int) -> torch.Tensor:
    """RWPE ``[N, steps]``: the return probabilities ``[(D^-1 A)^p]_ii``, ``p = 1..steps`` (undirected,
    no self-loops; isolated nodes zero), the diagonals of the symmetric ``S^p`` from powers up to
    ``ceil(steps / 2)`` of :data:`RWPE_BLOCK` of its columns at a time."""
    n = int(num_nodes)
    out = np.zeros((n, steps), dtype=np.float32)
    if n == 0 or steps == 0:
        return torch.from_numpy(out)
    sym = _normalised_adjacency(edge_index, n, np.float32)
    for start in range(0, n, RWPE_BLOCK):
        cols = np.arange(start, min(start + RWPE_BLOCK, n))
        # diag(S^(2a)) = colsum(S^a * S^a), diag(S^(2a-1)) = colsum(S^(a-1) * S^a) on these columns; diag(S) = 0
        prev, cur = None, sym[:, cols].toarray()
        for power in range(1, (steps + 1) // 2 + 1):
            if power > 1:
                prev, cur = cur, np.asarray(sym @ cur)
                out[cols, 2 * power - 2] = np.einsum("ij,ij->j", prev, cur)
            if 2 * power <= steps:
                out[cols, 2 * power - 1] = np.einsum("ij,ij->j", cur, cur)
    return torch.from_numpy(out)


def laplacian_pe(edge_index: torch.Tensor, num_nodes: int, dim: int) -> torch.Tensor:
    """Laplacian PE ``[N, dim]``: the eigenvectors of the ``dim`` smallest non-trivial eigenvalues of
    ``I - D^-1/2 A D^-1/2``; signs are arbitrary (the model flips them at random in training), graphs
    of fewer than ``dim + 1`` nodes zero-padded."""
    if dim < 1:
        raise ValueError(f"Laplacian PE needs dim >= 1, got {dim}")
    lap = np.eye(num_nodes) - _normalised_adjacency(edge_index, num_nodes, np.float64).toarray()
    _, vectors = np.linalg.eigh(lap)  # ascending eigenvalues
    out = np.zeros((num_nodes, dim), dtype=np.float32)
    take = min(dim, max(num_nodes - 1, 0))
    out[:, :take] = vectors[:, 1 : 1 + take]
    return torch.from_numpy(out)


def incident_edge_sum(edge_index: torch.Tensor, edge_attr: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """Sum of the features ``edge_attr [E, D]`` of the edges arriving at each node -> ``[N, D]``
    (ogbg-ppa's node input)."""
    out = torch.zeros(num_nodes, edge_attr.size(-1), dtype=edge_attr.dtype, device=edge_attr.device)
    return out.index_add_(0, edge_index[1], edge_attr)


def node_degree(edge_index: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """In-degree ``[N]`` (float32) of every node over ``edge_index`` (one graph or a batch), clamped
    at 1 so that isolated nodes stay finite: ``d_v`` of SAT's skip connection ``x_v + d_v^{-1/2}
    SA-attn(v)`` (Sec. 4.2), stored by the preprocessing stage as ``data.degree``."""
    deg = torch.zeros(num_nodes, dtype=torch.float32, device=edge_index.device)
    if edge_index.numel():
        deg.index_add_(0, edge_index[1], torch.ones(edge_index.size(1), dtype=torch.float32, device=edge_index.device))
    return deg.clamp_(min=1.0)
