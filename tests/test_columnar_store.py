"""The columnar raw store (preprocessing.columnar, preprocessing.conversion): bit for bit what OGB's own loader reads,
bounded memory whatever the input size, and a killed conversion resumes."""
from __future__ import annotations

import gzip
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from preprocessing import conversion
from preprocessing.columnar import STORE_DIR, STORE_FILE, file_specs, raw_fingerprint
from preprocessing.conversion import build_store
from preprocessing.config import DataConfig
from preprocessing.pycode import build_pycode
from preprocessing.sbm import build_sbm
from preprocessing.synthetic import build_synthetic_ppa
from tests.helpers import small_python_source
from tests.helpers import conversion_killed_in, load_source
from tests.ogb_reference import ogb_arrays


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    root = tmp_path_factory.mktemp("columnar")
    build_synthetic_ppa(root, 30, seed=1)
    build_pycode(root, [small_python_source(tmp_path_factory.mktemp("src"))], workers=1)
    build_sbm(root, "cluster", 12, seed=0)
    return root


@pytest.mark.parametrize("name", ["ogbg-ppa", "ogbg-code2"])
def test_store_equals_ogbs_loader(roots, name):
    store = load_source(DataConfig(name=name, root=str(roots)))
    ref = ogb_arrays(name, roots)
    everything = store.chunk(np.arange(store.num_graphs))
    assert np.array_equal(store.node_ptr, ref["node_ptr"]) and np.array_equal(store.edge_ptr, ref["edge_ptr"])
    for key in ("edge_index", "x", "node_depth", "node_is_attributed", "edge_attr", "y"):
        if key in ref:
            assert everything[key].dtype == ref[key].dtype, key
            assert np.array_equal(everything[key], ref[key]), key
    if "y_tokens" in ref:
        assert everything["y_tokens"] == ref["y_tokens"]
    for split, ids in ref["splits"].items():
        assert np.array_equal(store.splits[split], ids), split


def test_chunk_reads_any_graphs_in_any_order(roots):
    store = load_source(DataConfig(name="ogbg-ppa", root=str(roots)))
    everything = store.chunk(np.arange(store.num_graphs))
    ids = np.array([7, 2, 29, 2])
    part = store.chunk(ids)
    for j, g in enumerate(ids.tolist()):
        a, b = store.edge_ptr[g], store.edge_ptr[g + 1]
        c, d = part["edge_ptr"][j], part["edge_ptr"][j + 1]
        assert np.array_equal(part["edge_index"][:, c:d], everything["edge_index"][:, a:b])
        assert np.array_equal(part["edge_attr"][c:d], everything["edge_attr"][a:b])
    assert np.array_equal(part["y"], everything["y"][ids])


def test_sbm_store_equals_the_raw_files(roots):
    store = load_source(DataConfig(name="cluster", source="sbm", root=str(roots)))
    raw = roots / "sbm_cluster" / "raw"

    def table(name):
        with gzip.open(raw / name, "rt") as fh:
            return np.array([line.split(",") for line in fh.read().splitlines()], dtype=np.int64)

    everything = store.chunk(np.arange(store.num_graphs))
    edges = table("edge.csv.gz").T
    assert np.array_equal(everything["edge_index"][:, 0::2], edges)  # u->v, v->u interleaved, as OGB adds them
    assert np.array_equal(everything["edge_index"][:, 1::2], edges[::-1])
    assert np.array_equal(everything["x"], table("node-feat.csv.gz")[:, 0])
    assert np.array_equal(everything["node_label"], table("node-label.csv.gz")[:, 0])


def test_small_batches_and_blocks_give_the_same_store(roots, tmp_path, monkeypatch):
    """Rows cut into many record batches and parse blocks (as at full size) read back the same."""
    import shutil

    shutil.copytree(roots / "ogbg_ppa", tmp_path / "ogbg_ppa", ignore=shutil.ignore_patterns("columnar", "processed"))
    monkeypatch.setattr(conversion, "BATCH_ROWS", 1000)
    monkeypatch.setattr(conversion, "BLOCK_BYTES", 4096)
    small = load_source(DataConfig(name="ogbg-ppa", root=str(tmp_path)))
    big = load_source(DataConfig(name="ogbg-ppa", root=str(roots)))
    ids = np.array([29, 0, 13, 14, 3])
    a, b = small.chunk(ids), big.chunk(ids)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    import pyarrow as pa

    with pa.memory_map(str(tmp_path / "ogbg_ppa" / STORE_DIR / "edge_attr.arrow")) as source:
        assert pa.ipc.open_file(source).num_record_batches > 10


_KILLED = conversion_killed_in("ogbg-ppa", "edge_attr")  # SIGKILL in the middle of edge-feat.csv.gz


def test_killed_conversion_resumes_with_the_unfinished_files(roots, tmp_path):
    import shutil
    import signal

    folder = tmp_path / "ogbg_ppa"
    shutil.copytree(roots / "ogbg_ppa", folder, ignore=shutil.ignore_patterns("columnar", "processed"))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    killed = subprocess.run([sys.executable, "-c", _KILLED, str(folder)], env=env, capture_output=True)
    assert killed.returncode == -signal.SIGKILL
    store_dir = folder / STORE_DIR
    assert not (store_dir / STORE_FILE).exists()  # unfinished: never taken for a store
    assert any(p.name.startswith(".edge_attr.arrow.tmp") for p in store_dir.iterdir())  # killed mid-file
    kept = {p.name: p.stat().st_mtime_ns for p in store_dir.glob("*.arrow")}
    assert set(kept) >= {"num_nodes.arrow", "num_edges.arrow", "y.arrow", "edge_index.arrow"}
    converted = []
    fingerprint = raw_fingerprint(folder, "ogbg-ppa")
    store = build_store(folder, "ogbg-ppa", fingerprint,
                        run=lambda calls: [converted.append(a[2].key) or conversion.convert_file(*a) for a in calls])
    assert converted == ["edge_attr", "split-train", "split-valid", "split-test"]
    assert all((store_dir / name).stat().st_mtime_ns == ns for name, ns in kept.items())  # finished files kept
    assert not list(store_dir.glob(".*.tmp-*"))  # the killed run's temporary file is gone
    reference = load_source(DataConfig(name="ogbg-ppa", root=str(roots))).chunk(np.arange(30))
    resumed = store.chunk(np.arange(30))
    assert all(np.array_equal(resumed[k], reference[k]) for k in reference)
    # a finished store is reused as it is; new raw bytes (a new fingerprint) convert everything again
    assert build_store(folder, "ogbg-ppa", fingerprint, run=lambda calls: pytest.fail("converted again")).num_graphs == 30
    again = []
    build_store(folder, "ogbg-ppa", "another-fingerprint",
                run=lambda calls: [again.append(1) or conversion.convert_file(*a) for a in calls])
    assert len(again) == len(file_specs("ogbg-ppa")) - 2  # every file but the counts (read in the driver)


_PEAK = textwrap.dedent("""
    import sys
    import numpy as np
    import pyarrow.csv, sat.layout  # what the conversion and the reads import, before the baseline
    from preprocessing import conversion
    from preprocessing.columnar import raw_fingerprint
    from preprocessing.conversion import build_store

    def status(key):
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith(key))

    conversion.BATCH_ROWS, conversion.BLOCK_BYTES = 1 << 14, 1 << 19  # both inputs span many batches and blocks
    folder = sys.argv[1]
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # resets the peak (VmHWM) to the current RSS: the imports' own peak is not counted
    base = status("VmRSS:")
    store = build_store(folder, "ogbg-ppa", raw_fingerprint(folder, "ogbg-ppa"))
    for start in range(0, store.num_graphs, 64):  # read everything back, shard by shard
        store.chunk(np.arange(start, min(start + 64, store.num_graphs)))
    print(base, status("VmHWM:"))
""")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_conversion_memory_does_not_grow_with_the_input(tmp_path):
    """Peak RSS of converting and reading back 200 vs 1,600 ppa graphs (~20 MB vs ~160 MB of
    uncompressed CSV, each far more than one parse block or record batch): an in-memory loader
    grows by the data; the streaming one by the per-graph arrays only."""
    peaks = {}
    for graphs in (200, 1600):
        root = tmp_path / str(graphs)
        build_synthetic_ppa(root, graphs, seed=0)
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        run = subprocess.run([sys.executable, "-c", _PEAK, str(root / "ogbg_ppa")], capture_output=True, text=True,
                             env=env, check=True)
        base, peak = map(int, run.stdout.split()[-2:])  # KiB
        peaks[graphs] = (peak - base) / 1024  # MiB above the RSS after the imports
    # 1,400 more graphs hold ~3.2M more edges (~140 MB as int64 ids + float32 features in
    # memory); the growth allowed is a fifth of that
    assert peaks[200] > 0 and peaks[1600] - peaks[200] < 28, peaks
