"""Arrow shards end to end on the session's Ray: build, read back, determinism, resume, integrity."""
from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch_geometric.data import Batch

from preprocessing import DataConfig, ShardConfig, TransformConfig, preprocess, shard_dir
from preprocessing.reader import ShardDataset
from preprocessing.shard_places import FolderPlace
from preprocessing.shards import MANIFEST
from preprocessing.sources import iter_chunk
from tests.helpers import load_source, small_python_source
from preprocessing.transforms import transform_graph
from sat.data import SATData

pytestmark = pytest.mark.ray

TRANSFORM = TransformConfig(rwpe_steps=8, lap_pe_dim=2, k_hops=2)


@pytest.fixture(scope="module")
def code2(tmp_path_factory, ray_cluster):
    base = tmp_path_factory.mktemp("shards-code2")
    src = small_python_source(base / "src")
    data = DataConfig(name="ogbg-code2", root=str(base / "data"), source="pycode", source_dirs=[str(src)])
    shards = ShardConfig(root=str(base / "shards"), graphs_per_shard=64)
    out = preprocess(data, TRANSFORM, shards, progress=False)
    return data, shards, out


@pytest.fixture(scope="module")
def ppa(tmp_path_factory, ray_cluster):
    base = tmp_path_factory.mktemp("shards-ppa")
    data = DataConfig(name="ogbg-ppa", root=str(base / "data"), source="synthetic", synthetic_graphs=40)
    transform = TransformConfig(rwpe_steps=4, k_hops=1, ppa_node_input="edge_sum")
    shards = ShardConfig(root=str(base / "shards"), graphs_per_shard=16)
    return data, transform, preprocess(data, transform, shards, progress=False)


def _digests(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix == ".arrow" or p.name == "vocab.json"}


def test_manifest_and_splits(code2):
    data, shards, out = code2
    assert out == shard_dir(data, TRANSFORM, shards) and out.name.startswith("ogbg-code2-")
    manifest = json.loads((out / MANIFEST).read_text())
    store = load_source(data)
    assert manifest["schema_version"] == 1 and manifest["dataset"] == "ogbg-code2"
    assert manifest["source"]["fingerprint"] == store.fingerprint
    for split, ids in store.splits.items():
        assert manifest["splits"][split]["graphs"] == ids.size
        ds = ShardDataset(out, split)
        assert len(ds) == ids.size and np.array_equal(ds.graph_ids, ids)
    assert {s["file"] for s in manifest["shards"]} == {p.name for p in out.glob("*.arrow")}
    assert all(s["rows"] <= 64 and s["bytes"] == (out / s["file"]).stat().st_size for s in manifest["shards"])
    vocab = ShardDataset(out, "train").vocab
    assert vocab[-2:] == ["__UNK__", "__EOS__"] and manifest["num_vocab"] == len(vocab)


def test_items_equal_direct_transform(code2):
    data, _, out = code2
    store = load_source(data)
    ds = ShardDataset(out, "valid")
    index = {w: i for i, w in enumerate(ds.vocab)}
    for i in (0, len(ds) // 2, len(ds) - 1):
        item = ds[i]
        gid = int(item.graph_id)
        raw = next(iter_chunk(store.chunk(np.array([gid]))))
        ref = transform_graph(raw, "code2", TRANSFORM, index)
        assert isinstance(item, SATData) and item.y_tokens == ref["y_tokens"]
        for key in ("x", "edge_index", "edge_attr", "node_depth", "rwpe", "lap_pe", "degree",
                    "subgraph_node_index", "subgraph_edge_index", "subgraph_edge_id"):
            assert torch.equal(item[key], torch.as_tensor(ref[key]).to(item[key].dtype)), key
        assert item.y.shape == (1, 5) and item.y.dtype == torch.long and item.edge_index.dtype == torch.long
        assert torch.equal(item.subgraph_indicator, torch.repeat_interleave(torch.arange(item.num_nodes),
                                                                            torch.as_tensor(ref["subgraph_size"])))
    assert ds.num_nodes[len(ds) - 1] == ds[-1].num_nodes


def test_batches_collate_with_tokens_and_offsets(code2):
    ds = ShardDataset(code2[2], "train")
    items = [ds[i] for i in range(5)]
    batch = Batch.from_data_list(items)
    assert batch.y.shape == (5, 5) and batch.y_tokens == [g.y_tokens for g in items]
    ends = batch.subgraph_node_index[batch.subgraph_edge_index]
    assert torch.equal(ends, batch.edge_index[:, batch.subgraph_edge_id])


def test_reader_is_picklable_and_lazy(code2):
    ds = ShardDataset(code2[2], "train")
    clone = pickle.loads(pickle.dumps(ds))
    assert len(pickle.dumps(ds)) < 1000
    assert torch.equal(clone[3].x, ds[3].x) and np.array_equal(clone.num_nodes, ds.num_nodes)
    assert ds.num_nodes.sum() == ds.manifest["splits"]["train"]["nodes"]
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(ValueError, match="no split"):
        ShardDataset(code2[2], "dev")


def test_in_degree_histogram_counts_the_decoded_graphs_nodes(code2):
    """PNA's degree histogram read from the edge_index column, shard by shard, equals the one of
    the decoded graphs."""
    from torch_geometric.utils import degree

    for split in ("train", "valid"):
        ds = ShardDataset(code2[2], split)
        in_degrees = torch.cat([degree(ds[i].edge_index[1], num_nodes=ds[i].num_nodes).long() for i in range(len(ds))])
        expected = torch.bincount(in_degrees).tolist()
        assert ds.in_degree_histogram() == expected, split
        assert sum(expected) == int(ds.num_nodes.sum()) and len(expected) > 3
    assert len([s for s in ds.manifest["shards"] if s["split"] == "train"]) >= 2  # summed over shards


def test_deterministic_bytes(code2, tmp_path):
    data, shards, out = code2
    again = preprocess(data, TRANSFORM, shards.model_copy(update={"root": str(tmp_path)}), progress=False)
    assert again.name == out.name and _digests(again) == _digests(out)


def test_resume_skips_finished_and_redoes_bad_shards(code2, tmp_path):
    data, shards, out = code2
    copy = tmp_path / out.name
    shutil.copytree(out, copy)
    stamps = {p.name: p.stat().st_mtime_ns for p in copy.glob("*.arrow")}
    reference = _digests(copy)
    (copy / MANIFEST).unlink()  # as after a crash
    (copy / "train-00002.arrow").unlink()
    bad = copy / "train-00001.arrow"
    payload = bytearray(bad.read_bytes())
    payload[len(payload) // 2] ^= 0xFF
    bad.write_bytes(bytes(payload))
    stamps_bad = bad.stat().st_mtime_ns
    orphan = copy / ".train-00002.arrow.tmp-0a1b2c3d"  # what a task killed while writing leaves
    orphan.write_bytes(b"half a shard")
    preprocess(data, TRANSFORM, shards.model_copy(update={"root": str(tmp_path)}), progress=False)
    assert _digests(copy) == reference and not orphan.exists()
    for name, stamp in stamps.items():
        if name not in ("train-00001.arrow", "train-00002.arrow"):
            assert (copy / name).stat().st_mtime_ns == stamp, name  # skipped, not rewritten
    assert bad.stat().st_mtime_ns != stamps_bad


def test_changed_config_writes_a_new_directory(code2):
    data, shards, out = code2
    small = data.model_copy(update={"max_graphs_per_split": 10})
    other = preprocess(small, TRANSFORM.model_copy(update={"k_hops": 0}), shards, progress=False)
    assert other != out and other.parent == out.parent and (out / MANIFEST).is_file()
    ds = ShardDataset(other, "train")
    assert len(ds) == 10 and "subgraph_node_index" not in ds[0]
    assert set(ds.graph_ids) <= set(ShardDataset(out, "train").graph_ids)


def test_directory_of_another_config_is_rejected(code2, tmp_path):
    data, shards, out = code2
    target = shards.model_copy(update={"root": str(tmp_path)})
    other = TRANSFORM.model_copy(update={"rwpe_steps": 3})
    victim = shard_dir(data, other, target)
    victim.mkdir(parents=True)
    shutil.copy(out / MANIFEST, victim / MANIFEST)
    with pytest.raises(ValueError, match="another configuration"):
        preprocess(data, other, target, progress=False)


def test_corrupt_shard_is_named(code2, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(code2[2], copy)
    bad = copy / "train-00001.arrow"
    payload = bytearray(bad.read_bytes())
    payload[100] ^= 0xFF
    bad.write_bytes(bytes(payload))
    ds = ShardDataset(copy, "train")
    ds[0]  # other shards are fine
    with pytest.raises(ValueError, match="train-00001.arrow: corrupt shard"):
        ds[64]
    with pytest.raises(ValueError, match="train-00001.arrow"):
        ShardDataset(copy, "train").verify_all()
    bad.write_bytes(bytes(payload[:-10]))
    with pytest.raises(ValueError, match="train-00001.arrow: corrupt shard"):
        ShardDataset(copy, "train")


def test_atomic_write_leaves_nothing_on_failure(tmp_path, monkeypatch):
    def crash(*args):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        FolderPlace(tmp_path).write("x.arrow", b"data")
    assert list(tmp_path.iterdir()) == []


def test_bad_input_leaves_no_output(tmp_path, ray_cluster):
    from preprocessing.synthetic import build_synthetic_ppa
    import gzip

    build_synthetic_ppa(tmp_path / "data", 12)
    path = tmp_path / "data/ogbg_ppa/raw/edge.csv.gz"
    with gzip.open(path, "rt") as fh:
        lines = fh.read().splitlines()
    with gzip.open(path, "wt") as fh:
        fh.write("\n".join(["-1,0"] + lines[1:]) + "\n")
    shards = ShardConfig(root=str(tmp_path / "shards"))
    with pytest.raises(ValueError, match="line 1, graph 0: edge endpoint -1 outside"):
        preprocess(DataConfig(name="ogbg-ppa", root=str(tmp_path / "data")), TransformConfig(), shards)
    assert not (tmp_path / "shards").exists()


def test_ppa_shards(ppa):
    data, transform, out = ppa
    ds = ShardDataset(out, "train")
    assert ds.vocab is None and ds.manifest["num_classes"] == 37
    g = ds[1]
    assert g.x.dtype == torch.float32 and g.x.shape == (g.num_nodes, 7)
    assert g.edge_attr.dtype == torch.float32 and g.edge_attr.shape == (g.edge_index.size(1), 7)
    assert g.y.shape == (1,) and g.rwpe.shape == (g.num_nodes, 4) and "subgraph_node_index" in g
    # undirected: OGB's loader added the reverse of every edge
    e = g.edge_index
    assert torch.equal(e[:, 0::2].flip(0), e[:, 1::2])
    total = sum(len(ShardDataset(out, s)) for s in ("train", "valid", "test"))
    assert total == 40
    batch = Batch.from_data_list([ds[i] for i in range(3)])
    assert batch.y.shape == (3,)


def test_benchmark_ppa_graphs_are_laid_out_as_ppa_shard_rows(ppa):
    """The GPU check's ppa rows train on ``ppa_like_graphs``: the fields, dtypes and edge order that
    ``satp preprocess`` writes for ppa (``edge_sum`` node input), at ogbg-ppa's sizes."""
    from benchmarks.graphs.synthetic import ppa_like_graphs

    row = ShardDataset(ppa[2], "train")[0]
    graphs = ppa_like_graphs(24, seed=0)
    def width(data, key):  # the shape apart from the dimension batching concatenates
        shape = list(data[key].shape)
        del shape[data.__cat_dim__(key, data[key]) % len(shape)]
        return shape

    for g in graphs:
        for key in [k for k, v in g.items() if torch.is_tensor(v)]:
            assert key in row and g[key].dtype == row[key].dtype and width(g, key) == width(row, key), key
        e = g.edge_index
        assert torch.equal(e[:, 0::2].flip(0), e[:, 1::2]) and torch.equal(g.edge_attr[0::2], g.edge_attr[1::2])
        incident = torch.zeros(g.num_nodes, 7).index_add_(0, e[1], g.edge_attr)  # symmetric: either end
        torch.testing.assert_close(g.x, incident)
    nodes = sum(g.num_nodes for g in graphs)
    assert 190 < nodes / len(graphs) < 300 and 14 < sum(g.edge_index.size(1) for g in graphs) / nodes < 22


def test_finished_directory_is_validated_without_loading(code2, monkeypatch, tmp_path):
    import preprocessing.build as build

    data, shards, out = code2
    calls = []
    real = build.build_store
    monkeypatch.setattr(build, "build_store", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert preprocess(data, TRANSFORM, shards, progress=False) == out and not calls
    # a corrupt shard under a complete manifest is found and recomputed
    copy = tmp_path / out.name
    shutil.copytree(out, copy)
    reference = _digests(copy)
    bad = copy / "valid-00000.arrow"
    bad.write_bytes(bad.read_bytes()[:-1] + b"\0")
    preprocess(data, TRANSFORM, shards.model_copy(update={"root": str(tmp_path)}), progress=False)
    assert calls and _digests(copy) == reference
