"""`satp data synthetic-ppa`: blocks of graphs in worker processes, gzip members appended in block
order (the bytes do not depend on the workers), the fixed-point formatter, the shape of the data."""
from __future__ import annotations

import gzip
import hashlib
import json
import zlib
from pathlib import Path

import numpy as np
import pytest

from pipeline.cli import main
from preprocessing.ogb_layout import format_fixed_csv
from preprocessing import synthetic
from preprocessing.synthetic import NUM_CLASSES, build_synthetic_ppa

GRAPHS, BLOCK = 160, 16  # 10 blocks


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _ints(path: Path) -> np.ndarray:
    return np.array(gzip.open(path).read().split(), dtype=np.int64)


def _members(path: Path) -> int:
    data, members = path.read_bytes(), 0
    while data:
        dec = zlib.decompressobj(16 + zlib.MAX_WBITS)
        dec.decompress(data)
        assert dec.eof
        data, members = dec.unused_data, members + 1
    return members


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppa")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(synthetic, "BLOCK_GRAPHS", BLOCK)
        summary = build_synthetic_ppa(root / "one", GRAPHS, seed=3, workers=1)
        build_synthetic_ppa(root / "two", GRAPHS, seed=3, workers=2)
    return root, summary


def test_bytes_do_not_depend_on_workers(built):
    root, _ = built
    one = _digests(root / "one/ogbg_ppa")
    assert one == _digests(root / "two/ogbg_ppa")
    assert "raw/edge.csv.gz" in one and "split/species/test.csv.gz" in one and "RELEASE_v1.txt" in one


def test_multi_member_files_read_back(built):
    raw = built[0] / "one/ogbg_ppa/raw"
    nodes, edges = _ints(raw / "num-node-list.csv.gz"), _ints(raw / "num-edge-list.csv.gz")
    assert nodes.size == edges.size == GRAPHS
    for name in ("edge.csv.gz", "edge-feat.csv.gz"):
        assert _members(raw / name) == GRAPHS // BLOCK
    pairs = np.array(gzip.open(raw / "edge.csv.gz").read().replace(b",", b" ").split(), dtype=np.int64)
    assert pairs.size == 2 * edges.sum()
    lines = gzip.open(raw / "edge-feat.csv.gz").read().decode().splitlines()
    assert len(lines) == edges.sum() and all(len(line.split(",")) == 7 for line in lines[:: 997])
    # every edge is once, lo < hi, within its graph
    first = np.repeat(np.arange(GRAPHS), edges)
    lo, hi = pairs[0::2], pairs[1::2]
    assert (lo < hi).all() and (hi < nodes[first]).all()
    codes = first * 1000 * 1000 + lo * 1000 + hi
    assert np.unique(codes).size == codes.size


def test_shape_statistics(built):
    root, summary = built
    folder = root / "one/ogbg_ppa"
    nodes, edges = _ints(folder / "raw/num-node-list.csv.gz"), _ints(folder / "raw/num-edge-list.csv.gz")
    assert 200 < nodes.mean() < 290 and 15 < 2 * edges.sum() / nodes.sum() < 20  # measured: 243 nodes, degree 18
    assert summary["mean_nodes"] == pytest.approx(nodes.mean())
    assert summary["mean_degree"] == pytest.approx(2 * edges.sum() / nodes.sum())
    labels = _ints(folder / "raw/graph-label.csv.gz")
    assert set(labels.tolist()) == set(range(NUM_CLASSES))
    feats = np.array(gzip.open(folder / "raw/edge-feat.csv.gz").read().replace(b",", b" ").split(), dtype=np.float64)
    assert feats.min() >= 0 and feats.max() <= 1 and 0.3 < feats.mean() < 0.7
    splits = {s: _ints(folder / f"split/species/{s}.csv.gz") for s in ("train", "valid", "test")}
    assert summary["splits"] == {s: v.size for s, v in splits.items()}
    assert np.array_equal(np.sort(np.concatenate(list(splits.values()))), np.arange(GRAPHS))
    assert 0.45 < splits["train"].size / GRAPHS < 0.75 and min(v.size for v in splits.values()) > 0.1 * GRAPHS


def test_format_fixed_csv_equals_python_on_float32():
    rng = np.random.default_rng(0)
    values = rng.uniform(0, 9.9999, size=(3000, 7)).astype(np.float32)
    values[0] = [0.0, 1.0, 9.99994, 0.03125, 0.15625, 2.00005, 9.5]  # exact halves (1/32, 5/32) round to even
    expected = "".join(",".join(f"{v:.4f}" for v in row) + "\n" for row in values.tolist())
    assert format_fixed_csv(values, 4).decode() == expected
    halves = np.array([0.125, 0.375, 0.625, 2.5, 7.0], dtype=np.float32)  # 1-D: one value per line
    assert format_fixed_csv(halves, 2) == b"0.12\n0.38\n0.62\n2.50\n7.00\n"
    six = values[1:].reshape(-1)[:5000] * np.float32(0.9999)  # below 9.999995: none rounds to 10
    assert format_fixed_csv(six, 6).decode() == "".join(f"{v:.6f}\n" for v in six.tolist())
    assert format_fixed_csv(values[:0], 4) == b""


def test_format_fixed_csv_on_float64_differs_only_at_halves():
    values = np.random.default_rng(1).uniform(0, 9.9999, size=200_000)
    values[:1000] = (np.arange(1000) + 0.5) / 1e4  # decimal halves: not exact in binary
    got = format_fixed_csv(values, 4).decode().splitlines()
    python = [f"{v:.4f}" for v in values.tolist()]
    differ = np.flatnonzero([a != b for a, b in zip(got, python)])
    scaled = values[differ] * 1e4
    assert np.all(np.abs(scaled - np.floor(scaled) - 0.5) < 1e-9)  # only a value within rounding of a half
    assert np.all(np.abs(np.array([float(got[i]) - float(python[i]) for i in differ])) < 1.5e-4)


def test_format_fixed_csv_rejects_values_outside_the_range():
    assert format_fixed_csv(np.array([-0.0, -0.00004]), 4) == b"0.0000\n0.0000\n"  # rounds to zero: no sign
    for bad in ([-0.001], [9.99996], [np.nan], [12.0]):
        with pytest.raises(ValueError, match="round into"):
            format_fixed_csv(np.array(bad), 4)
    with pytest.raises(ValueError, match="decimals"):
        format_fixed_csv(np.array([1.0]), 0)


def test_arguments_and_cli(tmp_path, capsys):
    bad = (({"graphs": 2}, "--graphs"), ({"workers": 0}, "--workers"))
    for kwargs, word in bad:
        with pytest.raises(ValueError, match=word):
            build_synthetic_ppa(tmp_path / "bad", **{"graphs": 10, **kwargs})
    assert main(["data", "synthetic-ppa", "--out", str(tmp_path / "d"), "--graphs", "9", "--workers", "1"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["graphs"] == 9 and set(summary) == {"graphs", "mean_nodes", "mean_degree", "splits"}
    with pytest.raises(ValueError, match="already exists"):  # checked before any graph is made
        build_synthetic_ppa(tmp_path / "d", 10**9)
    with pytest.raises(SystemExit, match="2"):
        main(["data", "synthetic-ppa", "--out", str(tmp_path / "e"), "--workers", "0"])
    assert "--workers: expected a positive integer" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists() and not (tmp_path / "e").exists()
