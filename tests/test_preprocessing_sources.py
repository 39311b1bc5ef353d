"""Offline dataset builders (pycode, synthetic ppa), OGB loading of their raw layout, bad input."""
from __future__ import annotations

import ast
import gzip
import hashlib
from pathlib import Path

import numpy as np
import pytest

from preprocessing.config import DataConfig
from preprocessing.pycode import build_pycode
from preprocessing.python_graphs import MASK, function_graph, split_name
from preprocessing.columnar import required_files
from preprocessing.synthetic import build_synthetic_ppa
from tests.helpers import small_python_source
from tests.helpers import copy_dataset, load_source, rewrite_gz


@pytest.fixture(scope="module")
def pysrc(tmp_path_factory):
    return small_python_source(tmp_path_factory.mktemp("pysrc"))


@pytest.fixture(scope="module")
def code2_root(tmp_path_factory, pysrc):
    root = tmp_path_factory.mktemp("code2")
    build_pycode(root, [pysrc])
    return root


@pytest.fixture(scope="module")
def ppa_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppa")
    build_synthetic_ppa(root, 40, seed=0)
    return root


def _tree_digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and "processed" not in p.parts and "columnar" not in p.parts
    }


# ----------------------------------------------------------------------------- py2graph rules
def test_split_name_snake_and_camel():
    assert split_name("getHTTPResponse_code2") == ["get", "http", "response", "code", "2"]
    assert split_name("__init__") == ["init"]
    assert split_name("parse_args") == ["parse", "args"]


def test_function_graph_follows_ogb_py2graph():
    fn = ast.parse("def add_one(x):\n    return x + 1\n").body[0]
    g = function_graph(fn)
    # Module, FunctionDef, arguments, arg, Return, BinOp, Name, Load, Add, Constant (DFS pre-order)
    assert g.types == ["Module", "FunctionDef", "arguments", "arg", "Return", "BinOp", "Name", "Load", "Add", "Constant"]
    assert g.attrs[1] == MASK  # the method name is masked
    assert g.attrs[3] == "x" and g.attrs[6] == "x" and g.attrs[9] == "1"
    assert g.attrs[0] is None and g.attrs[7] is None
    assert g.depth == [0, 1, 2, 3, 2, 3, 4, 5, 4, 4]
    assert g.parent == [-1, 0, 1, 2, 1, 4, 5, 6, 5, 5]
    assert g.label == ["add", "one"]


def test_pycode_layout_is_ogbs_and_deterministic(tmp_path, pysrc, code2_root):
    folder = code2_root / "ogbg_code2"
    assert (folder / "RELEASE_v1.txt").is_file()
    for rel in required_files("ogbg-code2") + ["mapping/typeidx2type.csv.gz", "mapping/attridx2attr.csv.gz"]:
        assert (folder / rel).is_file(), rel
    with gzip.open(folder / "mapping/attridx2attr.csv.gz", "rt") as fh:
        lines = fh.read().splitlines()
    assert lines[0] == "attr idx,attr" and lines[-1].endswith("__NONE__") and lines[-2].endswith("__UNK__")
    with gzip.open(folder / "mapping/typeidx2type.csv.gz", "rt") as fh:
        assert fh.readline().strip() == "type idx,type"
    build_pycode(tmp_path, [pysrc])
    assert _tree_digest(tmp_path / "ogbg_code2") == _tree_digest(folder)
    with pytest.raises(ValueError, match="already exists"):
        build_pycode(tmp_path, [pysrc])


def test_pycode_output_does_not_depend_on_the_parsing_processes(tmp_path, pysrc):
    (pysrc / "broken_mod.py").write_text("def f(:\n")  # a failure must be reported the same way too
    try:
        summaries = {}
        for workers in (1, 3):
            summaries[workers] = build_pycode(tmp_path / str(workers), [pysrc], workers=workers)
    finally:
        (pysrc / "broken_mod.py").unlink()
    assert summaries[1] == summaries[3]
    assert summaries[1]["files_failed"] == 1 and "broken_mod.py" in summaries[1]["files_skipped"][0]
    assert _tree_digest(tmp_path / "1" / "ogbg_code2") == _tree_digest(tmp_path / "3" / "ogbg_code2")


def test_pycode_loads_through_ogb_with_project_split(code2_root):
    store = load_source(DataConfig(name="ogbg-code2", root=str(code2_root)))
    assert store.num_graphs > 200
    sizes = {k: v.size for k, v in store.splits.items()}
    assert all(sizes.values()) and sum(sizes.values()) == store.num_graphs
    projects = {}
    with gzip.open(code2_root / "ogbg_code2/mapping/graphidx2source.csv.gz", "rt") as fh:
        for line in fh.read().splitlines()[1:]:
            gid, project, _ = line.split(",", 2)
            projects[int(gid)] = project
    owners = {s: {projects[int(i)] for i in ids} for s, ids in store.splits.items()}
    assert not owners["train"] & owners["valid"] and not owners["train"] & owners["test"]
    assert not owners["valid"] & owners["test"]
    # trees, parent -> child, node ids in DFS order: every non-root node has exactly one parent
    everything = store.chunk(np.arange(store.num_graphs))
    g = 0
    ei = everything["edge_index"][:, store.edge_ptr[g] : store.edge_ptr[g + 1]]
    n = store.node_ptr[g + 1] - store.node_ptr[g]
    assert ei.shape[1] == n - 1 and (ei[0] < ei[1]).all() and np.array_equal(np.sort(ei[1]), np.arange(1, n))
    assert all(tokens and all(t == t.lower() for t in tokens) for tokens in everything["y_tokens"])


def test_synthetic_ppa_layout_and_shape(ppa_root, tmp_path):
    store = load_source(DataConfig(name="ogbg-ppa", root=str(ppa_root)))
    edge_attr = store.chunk(np.arange(store.num_graphs))["edge_attr"]
    assert store.num_graphs == 40 and edge_attr.shape[1] == 7
    assert 0.0 <= edge_attr.min() and edge_attr.max() <= 1.0
    nodes = np.diff(store.node_ptr)
    assert 150 < nodes.mean() < 350
    degree = np.diff(store.edge_ptr).sum() / nodes.sum()  # OGB added the reverse edges
    assert 14 < degree < 22
    assert set(store.y.tolist()) <= set(range(37)) and len(set(store.y.tolist())) > 30
    assert all(v.size for v in store.splits.values())
    build_synthetic_ppa(tmp_path, 40, seed=0)
    assert _tree_digest(tmp_path / "ogbg_ppa") == _tree_digest(ppa_root / "ogbg_ppa")


# ----------------------------------------------------------------------------- bad input
def _load_error(root: Path, name: str) -> str:
    with pytest.raises(ValueError) as info:
        load_source(DataConfig(name=name, root=str(root)))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_raw_file(ppa_root, tmp_path):
    root = copy_dataset(ppa_root, tmp_path, "ogbg_ppa")
    (root / "ogbg_ppa/raw/edge-feat.csv.gz").unlink()
    assert "edge-feat.csv.gz: missing" in _load_error(root, "ogbg-ppa")


def test_missing_release_file_does_not_prompt(ppa_root, tmp_path):
    root = copy_dataset(ppa_root, tmp_path, "ogbg_ppa")
    (root / "ogbg_ppa/RELEASE_v1.txt").unlink()
    assert "RELEASE_v1.txt missing" in _load_error(root, "ogbg-ppa")


def test_truncated_raw_file(code2_root, tmp_path):
    root = copy_dataset(code2_root, tmp_path, "ogbg_code2")
    path = root / "ogbg_code2/raw/node-feat.csv.gz"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    message = _load_error(root, "ogbg-code2")
    assert "node-feat.csv.gz" in message and "truncated" in message


def test_truncated_lines_detected(code2_root, tmp_path):
    root = copy_dataset(code2_root, tmp_path, "ogbg_code2")
    rewrite_gz(root / "ogbg_code2/raw/node_depth.csv.gz", lambda lines: lines[:-10])
    message = _load_error(root, "ogbg-code2")
    assert "node_depth.csv.gz" in message and "expected" in message


def test_edge_ids_out_of_range(ppa_root, tmp_path):
    root = copy_dataset(ppa_root, tmp_path, "ogbg_ppa")
    rewrite_gz(root / "ogbg_ppa/raw/edge.csv.gz", lambda lines: ["0,100000"] + lines[1:])
    message = _load_error(root, "ogbg-ppa")
    assert "graph 0" in message and "outside" in message and "edge.csv.gz" in message


def test_empty_graph(ppa_root, tmp_path):
    root = copy_dataset(ppa_root, tmp_path, "ogbg_ppa")
    rewrite_gz(root / "ogbg_ppa/raw/num-node-list.csv.gz", lambda lines: lines[:5] + ["0"] + lines[6:])
    assert "num-node-list.csv.gz: line 6, graph 5: node count 0, expected at least 1" in _load_error(root, "ogbg-ppa")


def test_graph_without_edges(ppa_root, tmp_path):
    root = copy_dataset(ppa_root, tmp_path, "ogbg_ppa")
    folder = root / "ogbg_ppa/raw"
    with gzip.open(folder / "num-edge-list.csv.gz", "rt") as fh:
        first = int(fh.readline())
    rewrite_gz(folder / "num-edge-list.csv.gz", lambda lines: ["0"] + lines[1:])
    rewrite_gz(folder / "edge.csv.gz", lambda lines: lines[first:])
    rewrite_gz(folder / "edge-feat.csv.gz", lambda lines: lines[first:])
    assert "num-edge-list.csv.gz: line 1, graph 0: edge count 0, expected at least 1" in _load_error(root, "ogbg-ppa")


@pytest.mark.parametrize("short", ["num-node-list.csv.gz", "num-edge-list.csv.gz"])
def test_a_cut_count_file_is_the_one_named(ppa_root, tmp_path, short):
    """One count file cut (as a copy that stopped half way): the error names it, with both counts,
    never the intact other one."""
    root = copy_dataset(ppa_root, tmp_path, "ogbg_ppa")
    other = ({"num-node-list.csv.gz", "num-edge-list.csv.gz"} - {short}).pop()
    rewrite_gz(root / "ogbg_ppa/raw" / short, lambda lines: lines[:15])
    message = _load_error(root, "ogbg-ppa")
    assert message.startswith(str(root / "ogbg_ppa/raw" / short) + ": 15 lines, "), message
    assert f"{other} has 40" in message and "truncated?" in message, message


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_non_finite_features(ppa_root, tmp_path, bad):
    root = copy_dataset(ppa_root, tmp_path, "ogbg_ppa")
    with gzip.open(root / "ogbg_ppa/raw/num-edge-list.csv.gz", "rt") as fh:
        first = int(fh.readline())
    rewrite_gz(root / "ogbg_ppa/raw/edge-feat.csv.gz",
             lambda lines: lines[: first + 3] + [",".join([bad] * 7)] + lines[first + 4 :])
    message = _load_error(root, "ogbg-ppa")
    assert f"edge-feat.csv.gz: line {first + 4}, graph 1: NaN or infinite edge feature" in message


def test_split_ids_out_of_range(ppa_root, tmp_path):
    root = copy_dataset(ppa_root, tmp_path, "ogbg_ppa")
    rewrite_gz(root / "ogbg_ppa/split/species/valid.csv.gz", lambda lines: lines + ["999"])
    assert "valid.csv.gz: line " in (message := _load_error(root, "ogbg-ppa")) and ": graph id 999 outside [0, 40)" in message


def test_unknown_dataset_name():
    with pytest.raises(ValueError, match="ogbg-code2"):
        DataConfig(name="ogbg-molhiv")


def test_builder_mismatch_rejected():
    with pytest.raises(ValueError, match="builds ogbg-code2"):
        DataConfig(name="ogbg-ppa", source="pycode")


def test_missing_dataset_offline_is_one_line_error(tmp_path, monkeypatch):
    import ogb.graphproppred.dataset_pyg as ogb_pyg

    def no_network(*args, **kwargs):
        raise OSError("<urlopen error no network>")

    monkeypatch.setattr(ogb_pyg, "download_url", no_network)
    message = _load_error(tmp_path, "ogbg-ppa")
    assert "could not download ogbg-ppa" in message
    assert not (tmp_path / "ogbg_ppa").exists()  # no partial folder left behind
