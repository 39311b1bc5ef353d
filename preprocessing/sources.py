"""Where a dataset's raw folder is, and building it when absent (``pycode``, ``synthetic``, ``sbm``, or
``ogb``'s download); :func:`iter_chunk` splits a :meth:`~preprocessing.columnar.ColumnarStore.chunk`
into graphs. OGB's in-memory loader is not used (ogbg-ppa needs ~80 GB)."""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import uuid
from pathlib import Path

from preprocessing.config import DataConfig
from preprocessing.ogb_layout import OGB_DIR


def dataset_dir(data: DataConfig) -> Path:
    return Path(data.root) / OGB_DIR[data.name]


_NODE_ARRAYS = ("x", "node_depth", "node_is_attributed", "node_label")  # chunk fields with one row per node


def iter_chunk(chunk: dict):
    """Yield one raw graph dict per graph of a :meth:`~preprocessing.columnar.ColumnarStore.chunk`."""
    nptr, eptr = chunk["node_ptr"], chunk["edge_ptr"]
    for j, gid in enumerate(chunk["graph_id"].tolist()):
        a, b, c, d = nptr[j], nptr[j + 1], eptr[j], eptr[j + 1]
        g = {"graph_id": gid, "num_nodes": int(b - a), "edge_index": chunk["edge_index"][:, c:d]}
        for key in _NODE_ARRAYS:
            if key in chunk:
                g[key] = chunk[key][a:b]
        if "edge_attr" in chunk:
            g["edge_attr"] = chunk["edge_attr"][c:d]
        if "y" in chunk:
            g["y"] = int(chunk["y"][j])
        if "y_tokens" in chunk:
            g["y_tokens"] = chunk["y_tokens"][j]
        yield g


def ensure_dataset(data: DataConfig) -> Path:
    """Create ``<root>/<ogb dir>`` with the configured offline builder when it is absent."""
    folder = dataset_dir(data)
    if folder.exists():
        return folder
    if data.source == "pycode":
        from preprocessing.pycode import build_pycode

        print(f"satp: building {folder} from Python source", file=sys.stderr)
        build_pycode(data.root, data.source_dirs or None, include_tests=data.include_tests)
    elif data.source == "synthetic":
        from preprocessing.synthetic import build_synthetic_ppa

        print(f"satp: writing a synthetic ogbg-ppa to {folder}", file=sys.stderr)
        build_synthetic_ppa(data.root, data.synthetic_graphs, seed=data.seed)
    elif data.source == "sbm":
        from preprocessing.sbm import build_sbm

        print(f"satp: regenerating {data.name.upper()} (SBM recipe, seed {data.seed}) in {folder}", file=sys.stderr)
        build_sbm(data.root, data.name, seed=data.seed)
    else:
        download_ogb(data.name, Path(data.root))
    return folder


def download_ogb(name: str, root: Path) -> Path:
    """Download ``root/<dataset dir>`` with OGB's download code and metadata into a temporary folder,
    renamed into place: a failed download leaves nothing."""
    import ogb.graphproppred.dataset_pyg as ogb_pyg
    import pandas as pd

    os.environ.setdefault("OUTDATED_IGNORE", "1")
    folder = root / OGB_DIR[name]
    master = pd.read_csv(Path(ogb_pyg.__file__).with_name("master.csv"), index_col=0, keep_default_na=False)
    meta = master[name]
    root_existed = root.exists()
    tmp = root / f".download-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir(parents=True)
        with contextlib.redirect_stdout(sys.stderr):
            archive = ogb_pyg.download_url(meta["url"], str(tmp))
            ogb_pyg.extract_zip(archive, str(tmp))
        os.replace(tmp / meta["download_name"], folder)
    except Exception as exc:  # urllib, zipfile, OS errors: one line
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"{folder}: ogb could not download {name}: {first}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not root_existed and root.is_dir() and not any(root.iterdir()):
            root.rmdir()
    return folder
