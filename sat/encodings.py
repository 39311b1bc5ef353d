"""Per-graph structural encodings, precomputed once per graph (Chen et al., ICML 2022, Sec. 3.3).

SAT combines its structure-aware attention with absolute encodings added to the
node inputs: RWPE (Dwivedi et al., 2022) and Laplacian eigenvectors (Dwivedi &
Bresson, 2021). These functions work on one graph's ``edge_index`` (``[2, E]``,
node ids in ``[0, N)``) and return float32 tensors. They are vectorised with
sparse matrices, so the preprocessing stage can call them at scale.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch


DENSE_RWPE_NODES = 4096  # above this, RWPE works on column blocks (an N x N array would not fit)
RWPE_BLOCK = 1024


def _undirected_adjacency(edge_index: torch.Tensor, num_nodes: int) -> sp.csr_matrix:
    edges = edge_index.detach().cpu().numpy().astype(np.int64, copy=False)
    rows = np.concatenate([edges[0], edges[1]])
    cols = np.concatenate([edges[1], edges[0]])
    keep = rows != cols
    adj = sp.csr_matrix(
        (np.ones(int(keep.sum()), dtype=np.float64), (rows[keep], cols[keep])), shape=(num_nodes, num_nodes)
    )
    adj.data[:] = 1.0  # duplicates and both directions collapse to one undirected edge
    return adj


def random_walk_pe(edge_index: torch.Tensor, num_nodes: int, steps: int) -> torch.Tensor:
    """RWPE: the return probabilities ``[(D^-1 A)^p]_ii`` for ``p = 1..steps``.

    Edges are taken as undirected, self-loops dropped; isolated nodes get zeros.
    ``(D^-1 A)^p`` has the diagonal of the symmetric ``S^p = (D^-1/2 A D^-1/2)^p``. Small graphs:
    the powers ``S^1..S^h`` (``h = ceil(steps / 2)``) by sparse-dense products, and as ``S`` is
    symmetric ``diag(S^(2a)) = rowsum(S^a * S^a)``, ``diag(S^(2a-1)) = rowsum(S^(a-1) * S^a)``.
    Large graphs (``N > DENSE_RWPE_NODES``): the same products on blocks of columns, so memory
    stays ``O(N * block)`` instead of ``O(N^2)``.

    Returns:
        ``[N, steps]`` float32.
    """
    n = int(num_nodes)
    out = np.zeros((n, steps), dtype=np.float32)
    if n == 0 or steps == 0:
        return torch.from_numpy(out)
    e = edge_index.detach().cpu().numpy().astype(np.int64, copy=False)
    keep = e[0] != e[1]
    a, b = e[0][keep], e[1][keep]
    key = np.unique(np.concatenate([a * n + b, b * n + a]))  # undirected, duplicates collapsed
    rows, cols = key // n, key % n
    deg = np.bincount(rows, minlength=n)
    inv_sqrt = np.zeros(n, dtype=np.float32)
    np.divide(1.0, np.sqrt(deg.astype(np.float32)), out=inv_sqrt, where=deg > 0)
    indptr = np.concatenate([[0], np.cumsum(deg)])
    sym = sp.csr_matrix((inv_sqrt[rows] * inv_sqrt[cols], cols, indptr), shape=(n, n))
    if n > DENSE_RWPE_NODES:
        for start in range(0, n, RWPE_BLOCK):
            cols_block = np.arange(start, min(start + RWPE_BLOCK, n))
            power = sym[:, cols_block].toarray()
            for p in range(steps):
                out[cols_block, p] = power[cols_block, np.arange(cols_block.size)]
                if p + 1 < steps:
                    power = np.asarray(sym @ power)
        return torch.from_numpy(out)
    # diag(S^(2a)) = rowsum(S^a * S^a), diag(S^(2a-1)) = rowsum(S^(a-1) * S^a); diag(S) = 0
    prev, cur = None, sym.toarray()
    for power in range(1, (steps + 1) // 2 + 1):
        if power > 1:
            prev, cur = cur, np.asarray(sym @ cur)
            out[:, 2 * power - 2] = np.einsum("ij,ij->i", prev, cur)
        if 2 * power <= steps:
            out[:, 2 * power - 1] = np.einsum("ij,ij->i", cur, cur)
    return torch.from_numpy(out)


def laplacian_pe(edge_index: torch.Tensor, num_nodes: int, dim: int) -> torch.Tensor:
    """Laplacian PE: the eigenvectors of the ``dim`` smallest non-trivial eigenvalues of the
    symmetric normalised Laplacian ``I - D^-1/2 A D^-1/2``.

    Signs are arbitrary (the model flips them at random in training); graphs with
    fewer than ``dim + 1`` nodes are zero-padded.

    Returns:
        ``[N, dim]`` float32.
    """
    if dim < 1:
        raise ValueError(f"Laplacian PE needs dim >= 1, got {dim}")
    adj = _undirected_adjacency(edge_index, num_nodes)
    deg = np.asarray(adj.sum(axis=1)).ravel()
    inv_sqrt = np.divide(1.0, np.sqrt(deg), out=np.zeros_like(deg), where=deg > 0)
    lap = np.eye(num_nodes) - (sp.diags(inv_sqrt) @ adj @ sp.diags(inv_sqrt)).toarray()
    _, vectors = np.linalg.eigh(lap)  # ascending eigenvalues
    out = np.zeros((num_nodes, dim), dtype=np.float32)
    take = min(dim, max(num_nodes - 1, 0))
    out[:, :take] = vectors[:, 1 : 1 + take]
    return torch.from_numpy(out)


def incident_edge_sum(edge_index: torch.Tensor, edge_attr: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """Sum of the features of the edges arriving at each node (ogbg-ppa's node input).

    Args:
        edge_index: ``[2, E]``.
        edge_attr: ``[E, D]`` float.

    Returns:
        ``[N, D]`` with the dtype of ``edge_attr``.
    """
    out = torch.zeros(num_nodes, edge_attr.size(-1), dtype=edge_attr.dtype, device=edge_attr.device)
    return out.index_add_(0, edge_index[1], edge_attr)


def node_degree(edge_index: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """In-degree of every node over ``edge_index`` (edges counted at their target), clamped at 1.

    This is ``d_v`` of SAT's degree-scaled skip connection ``x_v + d_v^{-1/2} SA-attn(v)``
    (Chen et al., ICML 2022, Sec. 4.2). The preprocessing stage stores it as ``data.degree``
    with this same function; :class:`sat.SAT` falls back to calling it when a batch lacks
    ``degree``. Clamping keeps isolated nodes (and the factor) finite.

    Args:
        edge_index: ``[2, E]`` long tensor (one graph or a batch).
        num_nodes: ``N``.

    Returns:
        ``[N]`` float32, every entry ``>= 1``.
    """
    deg = torch.zeros(num_nodes, dtype=torch.float32, device=edge_index.device)
    if edge_index.numel():
        deg.index_add_(0, edge_index[1], torch.ones(edge_index.size(1), dtype=torch.float32, device=edge_index.device))
    return deg.clamp_(min=1.0)
