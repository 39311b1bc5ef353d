"""PATTERN / CLUSTER by the SBM recipe (preprocessing.sbm): statistics, determinism, shards, bad input."""
from __future__ import annotations

import gzip
import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from torch_geometric.data import Batch

from pipeline.cli import main
from preprocessing import DataConfig, ShardConfig, TransformConfig, preprocess
from preprocessing import sbm
from preprocessing.ogb_layout import format_int_csv
from preprocessing.reader import ShardDataset
from preprocessing.sbm import RECIPES, build_sbm, generate, split_sizes
from preprocessing.sources import iter_chunk
from preprocessing.transforms import transform_graph
from tests.helpers import copy_dataset, load_source, rewrite_gz


@pytest.fixture(scope="module")
def pattern_sample():
    return generate("pattern", 560, seed=0)  # 4 pattern instances


@pytest.fixture(scope="module")
def cluster_sample():
    return generate("cluster", 600, seed=1)


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    root = tmp_path_factory.mktemp("sbm")
    build_sbm(root, "pattern", 42, seed=0)
    build_sbm(root, "cluster", 36, seed=0)
    return root


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _densities(graphs, group_of) -> dict[tuple[int, int], float]:
    """Pooled edge density per pair of node groups (``group_of(graph) -> [N] group ids``)."""
    edges: dict = {}
    pairs: dict = {}
    for g in graphs:
        group = group_of(g)
        counts = np.bincount(group, minlength=int(group.max()) + 1)
        for a in range(counts.size):
            for b in range(a, counts.size):
                total = counts[a] * (counts[a] - 1) // 2 if a == b else counts[a] * counts[b]
                pairs[(a, b)] = pairs.get((a, b), 0) + total
        ga, gb = np.sort(group[g.edges], axis=1).T
        for (a, b), n in zip(*np.unique(np.stack([ga, gb], axis=1), axis=0, return_counts=True)):
            edges[(int(a), int(b))] = edges.get((int(a), int(b)), 0) + int(n)
    return {k: edges.get(k, 0) / v for k, v in pairs.items() if v}


def expected_statistics(recipe, pattern_sizes: np.ndarray | None = None) -> dict[str, float]:
    """The recipe's expected nodes and edges (both directions) per graph, in closed form (what the
    generated graphs must average); PATTERN with ``pattern_sizes``: given those pattern sizes."""
    low, high = recipe.size_low, recipe.size_high - 1
    mean = (low + high) / 2
    square = ((high - low + 1) ** 2 - 1) / 12 + mean**2  # E[s^2] of the discrete uniform
    k = recipe.communities
    inside = k * (square - mean) / 2  # E[sum_r s_r (s_r - 1) / 2]
    pairs = (k * square + k * (k - 1) * mean**2 - k * mean) / 2  # E[n (n - 1) / 2], n = sum_r s_r
    nodes = k * mean
    undirected = recipe.p * inside + recipe.q * (pairs - inside)
    if recipe.patterns:
        if pattern_sizes is not None:
            sizes = np.asarray(pattern_sizes, dtype=np.float64)
            p_mean, p_square = float(sizes.mean()), float((sizes**2).mean())
        else:
            p_mean, p_square = mean, square
        nodes += p_mean
        undirected += recipe.pattern_q * p_mean * k * mean + recipe.pattern_p * (p_square - p_mean) / 2
    return {"nodes": nodes, "edges": 2 * undirected}


# ----------------------------------------------------------------------------- the recipe
def test_expected_statistics_closed_form():
    pattern, cluster = expected_statistics(RECIPES["pattern"]), expected_statistics(RECIPES["cluster"])
    # by hand: community sizes U{5..34}: mean 19.5, E[s^2] = 455.1667
    assert pattern["nodes"] == pytest.approx(117.0) and cluster["nodes"] == pytest.approx(117.0)
    assert pattern["edges"] == pytest.approx(5870.0, abs=0.5)
    assert cluster["edges"] == pytest.approx(4289.6, abs=0.5)
    assert cluster["edges"] == pytest.approx(sbm.PAPER_TABLE["cluster"]["edges"], rel=0.005)
    # the paper's PATTERN row is what the recipe gives when the 100 patterns average 21.4 nodes
    # (the spread of U{5..34}, shifted by +1.9) instead of 19.5
    given = expected_statistics(RECIPES["pattern"], np.arange(5, 35) + 1.9)
    assert given["nodes"] == pytest.approx(sbm.PAPER_TABLE["pattern"]["nodes"], rel=0.001)
    assert given["edges"] == pytest.approx(sbm.PAPER_TABLE["pattern"]["edges"], rel=0.002)


def test_split_sizes_and_instances():
    assert split_sizes(RECIPES["pattern"]) == (10000, 2000, 2000)
    assert split_sizes(RECIPES["cluster"]) == (10000, 1000, 1000)
    assert split_sizes(RECIPES["pattern"], 140) == (100, 20, 20)
    assert split_sizes(RECIPES["cluster"], 3) == (1, 1, 1)
    assert sbm.pattern_instances(RECIPES["pattern"], 14000) == 100
    assert sbm.pattern_instances(RECIPES["pattern"], 30) == 1
    with pytest.raises(ValueError, match="--graphs"):
        split_sizes(RECIPES["pattern"], 2)


def test_pattern_graphs_follow_the_recipe(pattern_sample):
    graphs, splits, instance_of = pattern_sample
    assert {k: v.size for k, v in splits.items()} == {"train": 400, "valid": 80, "test": 80}
    assert set(instance_of.tolist()) == {0, 1, 2, 3}
    for g in graphs:
        n = g.y.size
        assert g.edges.dtype == np.int32 and (g.edges[:, 0] < g.edges[:, 1]).all() and g.edges.max() < n
        assert np.unique(g.edges[:, 0].astype(np.int64) * n + g.edges[:, 1]).size == len(g.edges)  # simple graph
        assert set(np.unique(g.x)) <= {0, 1, 2} and set(np.unique(g.y)) <= {0, 1}
    # an instance's pattern (size, node attributes) is the same in all its graphs and splits
    for i in range(4):
        mine = [g for g, owner in zip(graphs, instance_of) if owner == i]
        signatures = {tuple(np.sort(g.x[g.y == 1]).tolist()) for g in mine}
        assert len(signatures) == 1 and 5 <= len(next(iter(signatures))) <= 34
    sbm_nodes = np.array([(g.y == 0).sum() for g in graphs])
    assert sbm_nodes.mean() == pytest.approx(97.5, abs=4.0) and 25 <= sbm_nodes.min() and sbm_nodes.max() <= 170
    # pooled densities: SBM-SBM p/q mix (closed form 0.3834), SBM-pattern 0.5, pattern-pattern ~0.5
    density = _densities(graphs, lambda g: g.y.astype(np.int64))
    assert density[(0, 0)] == pytest.approx(0.3834, abs=0.01)
    assert density[(0, 1)] == pytest.approx(0.5, abs=0.01)
    assert 0.3 < density[(1, 1)] < 0.7  # four fixed Erdos-Renyi patterns
    sizes = np.array([g.y.sum() for g in graphs])
    edges = 2 * np.mean([len(g.edges) for g in graphs])
    assert edges == pytest.approx(expected_statistics(RECIPES["pattern"], sizes)["edges"], rel=0.03)
    share = np.concatenate([g.y for g in graphs]).mean()
    assert share == pytest.approx(sizes.sum() / sum(g.y.size for g in graphs))


def test_cluster_graphs_follow_the_recipe(cluster_sample):
    graphs, splits, instance_of = cluster_sample
    assert instance_of is None and {k: v.size for k, v in splits.items()} == {"train": 500, "valid": 50, "test": 50}
    for g in graphs:
        assert set(np.unique(g.y)) == set(range(6))
        seeds = np.flatnonzero(g.x)
        assert seeds.size == 6 and np.array_equal(np.sort(g.x[seeds] - 1), np.arange(6))
        assert np.array_equal(g.x[seeds] - 1, g.y[seeds])  # each seed's input is its own community
        sizes = np.bincount(g.y, minlength=6)
        assert sizes.min() >= 5 and sizes.max() <= 34
    shares = np.bincount(np.concatenate([g.y for g in graphs]), minlength=6) / sum(g.y.size for g in graphs)
    assert np.allclose(shares, 1 / 6, atol=0.02)
    density = _densities(graphs, lambda g: g.y.astype(np.int64))
    inside = [density[(a, a)] for a in range(6)]
    across = [v for (a, b), v in density.items() if a != b]
    assert np.allclose(inside, 0.55, atol=0.02) and np.allclose(across, 0.25, atol=0.02)
    nodes = np.mean([g.y.size for g in graphs])
    edges = 2 * np.mean([len(g.edges) for g in graphs])
    assert nodes == pytest.approx(117.0, abs=5.0)
    assert edges == pytest.approx(expected_statistics(RECIPES["cluster"])["edges"], rel=0.05)


# ----------------------------------------------------------------------------- the raw layout
def test_format_int_csv_matches_python_join():
    rng = np.random.default_rng(0)
    for shape in [(300, 2), (77,), (40, 7)]:
        values = rng.integers(-10**7, 10**7, size=shape) * (rng.random(shape) < 0.5) + rng.integers(0, 12, size=shape)
        rows = values.reshape(values.shape[0], -1).tolist()
        assert format_int_csv(values) == "".join(",".join(map(str, r)) + "\n" for r in rows).encode()
    extremes = np.array([[np.iinfo(np.int64).min, np.iinfo(np.int64).max, 0, -1, 10]])
    assert format_int_csv(extremes) == (",".join(map(str, extremes[0].tolist())) + "\n").encode()
    assert format_int_csv(np.zeros((0, 2), dtype=np.int64)) == b""


def test_layout_and_determinism(tmp_path, roots):
    folder = roots / "sbm_pattern"
    for rel in ("RELEASE_v1.txt", "sbm.json", "raw/edge.csv.gz", "raw/node-feat.csv.gz", "raw/node-label.csv.gz",
                "raw/num-node-list.csv.gz", "raw/num-edge-list.csv.gz", "split/benchmark/train.csv.gz",
                "split/benchmark/valid.csv.gz", "split/benchmark/test.csv.gz", "mapping/graphidx2pattern.csv.gz"):
        assert (folder / rel).is_file(), rel
    assert not (roots / "sbm_cluster/mapping").exists()
    with gzip.open(folder / "raw/edge.csv.gz", "rt") as fh:
        u, v = map(int, fh.readline().split(","))
    assert u < v
    summary = build_sbm(tmp_path, "pattern", 42, seed=0)
    assert summary["graphs"] == 42 and summary["splits"] == {"train": 30, "valid": 6, "test": 6}
    assert _digests(tmp_path / "sbm_pattern") == _digests(folder)  # byte-identical for the same seed
    with pytest.raises(ValueError, match="already exists"):
        build_sbm(tmp_path, "pattern", 42, seed=0)
    build_sbm(tmp_path, "pattern", 42, seed=1, force=True)
    other = _digests(tmp_path / "sbm_pattern")
    assert other["raw/edge.csv.gz"] != _digests(folder)["raw/edge.csv.gz"]
    assert [p.name for p in tmp_path.iterdir()] == ["sbm_pattern"]  # no temporary folder left


def test_cli_prints_statistics(tmp_path, capsys):
    assert main(["data", "sbm-cluster", "--out", str(tmp_path), "--graphs", "24", "--seed", "2"]) == 0
    out = capsys.readouterr().out
    assert "CLUSTER (seed 2)" in out and "avg edges (both directions)" in out and "4,303.9" in out
    assert "20/2/2" in out and (tmp_path / "sbm_cluster/RELEASE_v1.txt").is_file()
    assert main(["data", "sbm-pattern", "--out", str(tmp_path), "--graphs", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--graphs" in err[0] and not (tmp_path / "sbm_pattern").exists()


def test_loads_into_a_raw_store(roots):
    store = load_source(DataConfig(name="cluster", source="sbm", root=str(roots)))
    assert store.name == "cluster" and store.num_graphs == 36
    assert {k: v.size for k, v in store.splits.items()} == {"train": 30, "valid": 3, "test": 3}
    everything = store.chunk(np.arange(store.num_graphs))
    assert everything["x"].shape == everything["node_label"].shape == (store.node_ptr[-1],)
    with gzip.open(roots / "sbm_cluster/raw/num-edge-list.csv.gz", "rt") as fh:
        undirected = np.array(fh.read().split(), dtype=np.int64)
    assert np.array_equal(np.diff(store.edge_ptr), 2 * undirected)  # both directions
    ei = everything["edge_index"][:, : store.edge_ptr[1]]
    assert np.array_equal(ei[:, 0::2], ei[::-1, 1::2])
    raw = next(iter_chunk(store.chunk(np.array([5]))))
    assert raw["num_nodes"] == raw["node_label"].size == raw["x"].size


# ----------------------------------------------------------------------------- shards end to end
@pytest.mark.ray
def test_preprocess_into_shards_with_node_labels(tmp_path, roots, ray_cluster):
    transform = TransformConfig(rwpe_steps=7, k_hops=1)
    shards = ShardConfig(root=str(tmp_path / "shards"), graphs_per_shard=16)
    data = DataConfig(name="pattern", source="sbm", root=str(roots))
    out = preprocess(data, transform, shards, progress=False)
    assert out.name.startswith("pattern-")
    store = load_source(data)
    ds = ShardDataset(out, "train")
    assert ds.manifest["task"] == "pattern" and ds.manifest["num_classes"] == 2 and len(ds) == 30
    assert ds.vocab is None and "edge_attr" not in ds.manifest["columns"]
    for i in (0, len(ds) - 1):
        item = ds[i]
        n = item.num_nodes
        assert item.x.shape == (n, 1) and item.x.dtype == torch.long
        assert item.y.shape == (n,) and item.y.dtype == torch.long
        assert item.rwpe.shape == (n, 7) and item.subgraph_indicator.numel() > n
        raw = next(iter_chunk(store.chunk(item.graph_id.numpy())))
        ref = transform_graph(raw, "pattern", transform)
        assert torch.equal(item.y, torch.as_tensor(raw["node_label"]))
        for key in ("x", "edge_index", "rwpe", "degree", "subgraph_node_index", "subgraph_edge_index"):
            assert torch.equal(item[key], torch.as_tensor(ref[key]).to(item[key].dtype)), key
    batch = Batch.from_data_list([ds[i] for i in range(3)])
    assert batch.y.shape == (batch.num_nodes,) and batch.x.shape == (batch.num_nodes, 1)


@pytest.mark.ray
def test_sbm_source_builds_a_missing_folder(tmp_path, monkeypatch, ray_cluster):
    real = sbm.build_sbm
    monkeypatch.setattr(sbm, "build_sbm", lambda root, name, seed=0: real(root, name, 24, seed=seed))
    data = DataConfig(name="cluster", source="sbm", root=str(tmp_path / "data"), seed=3)
    out = preprocess(data, TransformConfig(rwpe_steps=3, k_hops=0), ShardConfig(root=str(tmp_path / "s")), progress=False)
    assert (tmp_path / "data/sbm_cluster/RELEASE_v1.txt").is_file()
    item = ShardDataset(out, "valid")[0]
    assert item.y.shape == (item.num_nodes,) and int(item.y.max()) < 6 and item.x.max() <= 6
    assert ShardDataset(out, "valid").manifest["num_classes"] == 6


# ----------------------------------------------------------------------------- bad input
def _copy(roots: Path, tmp: Path) -> Path:
    return copy_dataset(roots, tmp, "sbm_cluster")


def _load_error(root: Path) -> str:
    with pytest.raises(ValueError) as info:
        load_source(DataConfig(name="cluster", source="sbm", root=str(root)))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_truncated_file_is_named(roots, tmp_path):
    root = _copy(roots, tmp_path)
    path = root / "sbm_cluster/raw/edge.csv.gz"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    message = _load_error(root)
    assert "edge.csv.gz" in message and "truncated" in message


def test_missing_and_short_files_are_named(roots, tmp_path):
    root = _copy(roots, tmp_path)
    (root / "sbm_cluster/raw/node-label.csv.gz").unlink()
    assert "node-label.csv.gz: missing" in _load_error(root)
    root = _copy(roots, tmp_path / "b")
    rewrite_gz(root / "sbm_cluster/raw/node-feat.csv.gz", lambda lines: lines[:-3])
    message = _load_error(root)
    assert "node-feat.csv.gz" in message and "expected" in message


def test_bad_values_are_named(roots, tmp_path):
    root = _copy(roots, tmp_path)
    rewrite_gz(root / "sbm_cluster/raw/node-label.csv.gz", lambda lines: lines[:3] + ["6"] + lines[4:])
    assert "node-label.csv.gz: line 4, graph 0: node class 6 outside [0, 6)" in _load_error(root)
    root = _copy(roots, tmp_path / "b")
    rewrite_gz(root / "sbm_cluster/raw/edge.csv.gz", lambda lines: lines[:2] + ["1;2"] + lines[3:])
    message = _load_error(root)
    assert "edge.csv.gz" in message and "integer" in message
    root = _copy(roots, tmp_path / "c")
    rewrite_gz(root / "sbm_cluster/raw/edge.csv.gz", lambda lines: ["0,500"] + lines[1:])
    assert "edge.csv.gz: line 1, graph 0: edge endpoint 500 outside [0, " in _load_error(root)


def test_config_ties_sbm_to_its_datasets():
    with pytest.raises(ValueError, match="source 'sbm'"):
        DataConfig(name="pattern")
    with pytest.raises(ValueError, match="source 'sbm'"):
        DataConfig(name="ogbg-ppa", source="sbm")
    assert DataConfig(name="cluster", source="sbm").source == "sbm"
