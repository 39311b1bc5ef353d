"""Graph data with precomputed SAT indices, batched by PyG's collation.

:class:`SATData` is a PyG ``Data`` carrying the k-hop subgraph indices of the k-subgraph extractor
(Chen et al., ICML 2022, Sec. 3.1) and the absolute encodings (Sec. 3.3); batching offsets the
indices (:meth:`SATData.__inc__`, as PyG's ``RootedSubgraphData``). Attributes: ``x [N, F]``,
``edge_index [2, E]``, optional ``edge_attr [E, D]``, ``rwpe [N, P]``, ``lap_pe [N, M]``,
``node_depth [N]``; ``subgraph_node_index [S]`` (node of each entry), ``subgraph_indicator [S]``
(its centre), ``subgraph_edge_index [2, Es]`` (edges between entries), ``subgraph_edge_id [Es]``
(their ids in ``edge_index``). Entries are sorted by centre, then node; a centre is in its own subgraph."""
from __future__ import annotations

from typing import Any

import numpy as np
import scipy.sparse as sp
import torch
from torch_geometric.data import Data

SUBGRAPH_KEYS = ("subgraph_node_index", "subgraph_indicator", "subgraph_edge_index", "subgraph_edge_id")


class SATData(Data):
    """A graph with SAT's precomputed indices; see the module docstring for the layout."""

    def __inc__(self, key: str, value: Any, *args, **kwargs) -> Any:
        if key in ("subgraph_node_index", "subgraph_indicator"):
            return self.num_nodes
        if key == "subgraph_edge_index":
            return self.subgraph_node_index.numel()
        if key == "subgraph_edge_id":
            return self.edge_index.size(1)
        return super().__inc__(key, value, *args, **kwargs)

    def __cat_dim__(self, key: str, value: Any, *args, **kwargs) -> Any:
        if key == "subgraph_edge_index":
            return 1
        return super().__cat_dim__(key, value, *args, **kwargs)


def k_hop_subgraph_indices(edge_index: torch.Tensor, num_nodes: int, k: int) -> dict[str, torch.Tensor]:
    """Every node's k-hop subgraph indices of one graph (``edge_index [2, E]``, ``k >= 1``): the four
    ``SUBGRAPH_KEYS`` tensors. Reachability is the support of ``(A + I)^k`` (edges undirected); an
    edge belongs to a centre's subgraph when both ends do. Cost grows with the subgraphs' total size."""
    if k < 1:
        raise ValueError(f"k must be >= 1 for k-hop subgraphs, got {k}")
    edges = edge_index.detach().cpu().numpy().astype(np.int64, copy=False)
    if edges.size and (edges.min() < 0 or edges.max() >= num_nodes):
        raise ValueError(f"edge_index holds node ids outside [0, {num_nodes})")
    n = int(num_nodes)
    src, dst = edges[0], edges[1]
    loops = np.arange(n, dtype=np.int64)
    # A + I, undirected, as a canonical CSR built directly from the sorted keys row * N + col
    keys = np.unique(np.concatenate([src * n + dst, dst * n + src, loops * (n + 1)]))
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(keys // n, minlength=n), out=indptr[1:])
    adj = sp.csr_matrix((np.ones(keys.size, dtype=np.float32), keys % n, indptr), shape=(n, n))
    reach = adj
    for _ in range(k - 1):
        reach = reach @ adj
        reach.sort_indices()
    # entries in CSR order: sorted by centre, then node id
    node = reach.indices.astype(np.int64)
    centre = np.repeat(loops, np.diff(reach.indptr))
    # candidate (entry, edge) pairs: every edge leaving an entry's node, kept when the edge's
    # target is an entry of the same centre (binary search in the sorted centre * N + node keys)
    by_src = np.argsort(src, kind="stable")
    src_ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(src, minlength=n), out=src_ptr[1:])
    out_deg = src_ptr[node + 1] - src_ptr[node]
    entry = np.repeat(np.arange(node.size), out_deg)
    shift = src_ptr[node]
    shift[1:] -= np.cumsum(out_deg)[:-1]
    edge_id = by_src[np.arange(entry.size) + np.repeat(shift, out_deg)]
    wanted = centre[entry] * n + dst[edge_id]
    flat = centre * n + node
    pos_dst = np.minimum(np.searchsorted(flat, wanted), max(flat.size - 1, 0))
    inside = np.flatnonzero(flat[pos_dst] == wanted)
    entry, edge_id, pos_dst = entry[inside], edge_id[inside], pos_dst[inside]
    order = np.argsort(centre[entry] * max(src.size, 1) + edge_id, kind="stable")
    return {
        "subgraph_node_index": torch.from_numpy(node),
        "subgraph_indicator": torch.from_numpy(centre),
        "subgraph_edge_index": torch.from_numpy(np.stack([entry[order], pos_dst[order]])),
        "subgraph_edge_id": torch.from_numpy(edge_id[order]),
    }


def add_subgraph_indices(data: Data, k: int) -> SATData:
    """Return ``data`` as :class:`SATData` with its k-hop subgraph indices attached."""
    out = data if isinstance(data, SATData) else SATData(**{key: value for key, value in data})
    for key, value in k_hop_subgraph_indices(data.edge_index, data.num_nodes, k).items():
        out[key] = value
    return out
