"""OGB's own in-memory loader, the reference the columnar store is checked against (tests only)."""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import numpy as np


def ogb_arrays(name: str, root: Path) -> dict:
    """Dataset ``name`` under ``root`` read by ``ogb.graphproppred.PygGraphPropPredDataset``:
    every field concatenated as numpy arrays, with OGB's splits (its processed cache is written
    to ``<folder>/processed``)."""
    import torch
    from torch_geometric.data.data import DataEdgeAttr, DataTensorAttr
    from torch_geometric.data.storage import GlobalStorage

    os.environ.setdefault("OUTDATED_IGNORE", "1")
    torch.serialization.add_safe_globals([DataEdgeAttr, DataTensorAttr, GlobalStorage])
    from ogb.graphproppred import PygGraphPropPredDataset

    with contextlib.redirect_stdout(sys.stderr):
        ds = PygGraphPropPredDataset(name=name, root=str(root))
    data, slices = ds._data, ds.slices
    counts = [ds[i].num_nodes for i in range(len(ds))]
    out = {
        "node_ptr": np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        "edge_ptr": slices["edge_index"].numpy().astype(np.int64),
        "edge_index": data.edge_index.numpy(),
        "splits": {k: v.numpy() for k, v in ds.get_idx_split().items()},
    }
    if name == "ogbg-code2":
        out["x"] = data.x.numpy()
        out["node_depth"] = data.node_depth.numpy().reshape(-1)
        out["node_is_attributed"] = data.node_is_attributed.numpy().reshape(-1)
        out["y_tokens"] = list(data.y)
    else:
        out["edge_attr"] = data.edge_attr.numpy()
        out["y"] = data.y.numpy().reshape(-1)
    return out
