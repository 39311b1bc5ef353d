"""Raw values out of range are refused while the columnar store is converted (preprocessing.raw_checks),
in one line naming the file, the line, the graph, the field and the range, before anything is written.

A value ``99999,<attr>`` on one row of code2's ``raw/node-feat.csv.gz`` passed ``satp
preprocess`` and training failed 58 s later in every worker, naming neither the file nor the graph.
"""
from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from preprocessing.columnar import STORE_DIR, STORE_FILE, raw_fingerprint
from preprocessing.conversion import build_store
from preprocessing.pycode import build_pycode
from preprocessing.synthetic import build_synthetic_ppa
from tests.helpers import small_python_source

ROOT = Path(__file__).resolve().parents[1]
MODULES = ("textwrap.py", "shlex.py", "csv.py")  # three projects: the smallest dataset with three splits


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("raw-checks")
    build_pycode(root, [small_python_source(root / "src", MODULES)], workers=1)
    build_synthetic_ppa(root, 12, seed=0)
    return root


def _lines(path: Path) -> list[str]:
    with gzip.open(path, "rt") as fh:
        return fh.read().splitlines()


def _copy(datasets: Path, tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    shutil.copytree(datasets / name, folder, ignore=shutil.ignore_patterns(STORE_DIR))
    return folder


def _set_line(path: Path, line: int, text: str) -> None:
    lines = _lines(path)
    lines[line - 1] = text
    with gzip.open(path, "wt") as fh:
        fh.write("\n".join(lines) + "\n")


def _first_node_of(folder: Path, graph: int) -> int:
    nodes = np.array([int(v) for v in _lines(folder / "raw/num-node-list.csv.gz")])
    return int(nodes[:graph].sum())


def _refused(folder: Path, name: str) -> str:
    with pytest.raises(ValueError) as info:
        build_store(folder, name, raw_fingerprint(folder, name))
    message = str(info.value)
    assert "\n" not in message
    store = folder / STORE_DIR
    assert not (store / STORE_FILE).exists()  # never taken for a finished store
    assert not list(store.glob(".*.tmp-*"))  # no temporary file left
    return message


def _edit_node_row(column_values):
    def edit(folder: Path) -> tuple[str, int]:
        row = _first_node_of(folder, 2) + 1  # graph 2's second node
        path = folder / "raw/node-feat.csv.gz"
        values = _lines(path)[row].split(",")
        for column, value in column_values.items():
            values[column] = value
        _set_line(path, row + 1, ",".join(values))
        return "raw/node-feat.csv.gz", row + 1
    return edit


def _edit_one(rel: str, graph_row, text: str):
    def edit(folder: Path) -> tuple[str, int]:
        row = graph_row(folder)
        _set_line(folder / rel, row + 1, text)
        return rel, row + 1
    return edit


CODE2 = [
    (_edit_node_row({0: "99999"}), "graph 2: node type id 99999 outside [0, "),
    (_edit_node_row({1: "777777"}), "graph 2: node attribute id 777777 outside [0, "),
    (_edit_node_row({0: "-1"}), "graph 2: node type id -1 outside [0, "),
    (_edit_one("raw/edge.csv.gz", lambda f: 0, "0,100000"), "graph 0: edge endpoint 100000 outside [0, "),
    (_edit_one("raw/node_depth.csv.gz", lambda f: _first_node_of(f, 2), "-4"), "graph 2: depth -4, expected at least 0"),
    (_edit_one("raw/node_is_attributed.csv.gz", lambda f: _first_node_of(f, 2), "2"),
     "graph 2: attributed flag 2 outside [0, 2)"),
    (_edit_one("raw/node_dfs_order.csv.gz", lambda f: _first_node_of(f, 2), "5000"),
     "graph 2: DFS position 5000 outside [0, "),
    (_edit_one("raw/num-node-list.csv.gz", lambda f: 3, "-3"), "line 4, graph 3: node count -3, expected at least 1"),
    (_edit_one("split/project/test.csv.gz", lambda f: 0, "99999"), "line 1: graph id 99999 outside [0, "),
]
PPA = [
    (_edit_one("raw/graph-label.csv.gz", lambda f: 5, "37"), "line 6, graph 5: class id 37 outside [0, 37)"),
    (_edit_one("raw/num-edge-list.csv.gz", lambda f: 4, "0"), "line 5, graph 4: edge count 0, expected at least 1"),
    (_edit_one("raw/edge-feat.csv.gz", lambda f: 2, "nan,0,0,0,0,0,0"), "line 3, graph 0: NaN or infinite edge feature"),
]


@pytest.mark.parametrize("edit,expected", CODE2, ids=[e for _, e in CODE2])
def test_code2_values_out_of_range_are_named(datasets, tmp_path, edit, expected):
    folder = _copy(datasets, tmp_path, "ogbg_code2")
    rel, line = edit(folder)
    message = _refused(folder, "ogbg-code2")
    assert message.startswith(f"{folder / rel}: line {line}") and expected in message, message


@pytest.mark.parametrize("edit,expected", PPA, ids=[e for _, e in PPA])
def test_ppa_values_out_of_range_are_named(datasets, tmp_path, edit, expected):
    folder = _copy(datasets, tmp_path, "ogbg_ppa")
    rel, _ = edit(folder)
    message = _refused(folder, "ogbg-ppa")
    assert message.startswith(f"{folder / rel}: ") and expected in message, message


def test_a_graph_in_two_splits_is_named(datasets, tmp_path):
    folder = _copy(datasets, tmp_path, "ogbg_ppa")
    train = _lines(folder / "split/species/train.csv.gz")
    _set_line(folder / "split/species/test.csv.gz", 1, train[0])
    message = _refused(folder, "ogbg-ppa")
    assert message == f"{folder / 'split/species/test.csv.gz'}: line 1: graph id {train[0]} is also in the train split"


def test_the_range_of_code2_ids_is_the_datasets_mapping(datasets):
    """The bound is the dataset's mapping table when it lists fewer ids than the model embeds."""
    from preprocessing.columnar import file_specs
    from preprocessing.raw_checks import CODE2_NODE_TYPES, ranges

    spec = next(s for s in file_specs("ogbg-code2") if s.key == "x")
    types, attrs = ranges("ogbg-code2", spec, datasets / "ogbg_code2", None)
    mapped = len(_lines(datasets / "ogbg_code2/mapping/typeidx2type.csv.gz")) - 1
    assert (types.column, types.hi) == (0, min(mapped, CODE2_NODE_TYPES)) and "typeidx2type" in types.why
    assert attrs.column == 1 and attrs.hi < 10030


@pytest.mark.ray
def test_satp_preprocess_refuses_an_out_of_range_node_type(datasets, tmp_path, ray_cluster):
    """The out-of-range node type through the command: one ``satp: error:`` line, exit 2, nothing written."""
    shutil.copytree(datasets / "ogbg_code2", tmp_path / "data/ogbg_code2", ignore=shutil.ignore_patterns(STORE_DIR))
    folder = tmp_path / "data/ogbg_code2"
    rel, line = _edit_node_row({0: "99999"})(folder)
    job = tmp_path / "job.yaml"
    job.write_text(f"name: t\nmodel: {{}}\ndata: {{name: ogbg-code2, root: {tmp_path / 'data'}, source: pycode}}\n"
                   f"transform: {{rwpe_steps: 0, k_hops: 0}}\nshards: {{root: {tmp_path / 'shards'}}}\n")
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "preprocess", str(job), "--no-progress",
                           "--address", ray_cluster.get_runtime_context().gcs_address],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=dict(os.environ))
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("satp:")]  # (and Ray's "Connected")
    assert len(lines) == 1 and lines[0].startswith(f"satp: error: {folder / rel}: line {line}, graph 2: "
                                                   "node type id 99999 outside [0, "), proc.stderr
    store = folder / STORE_DIR
    assert not (store / STORE_FILE).exists() and not list(store.glob(".*.tmp-*"))
    assert not (tmp_path / "shards").exists()


@pytest.mark.parametrize("name, edit, expected", [("ogbg-code2", e, x) for e, x in CODE2] + [("ogbg-ppa", e, x) for e, x in PPA],
                         ids=[x for _, x in CODE2 + PPA])
def test_the_preflight_check_names_what_the_conversion_names(datasets, tmp_path, name, edit, expected):
    """the same checks, on the raw files as they are, writing nothing (the pre-flight's)."""
    from preprocessing.conversion import check_values

    folder = _copy(datasets, tmp_path, name.replace("-", "_"))
    edit(folder)
    with pytest.raises(ValueError) as info:
        check_values(folder, name)
    assert str(info.value) == _refused(folder, name)
    assert expected in str(info.value)


def test_satp_train_names_an_out_of_range_value_before_ray_starts(datasets, tmp_path):
    """the raw-data range check came after Ray started (54-93 s); it is the pre-flight's
    now: one line, status 2, and neither Ray nor torch was imported."""
    shutil.copytree(datasets / "ogbg_code2", tmp_path / "data/ogbg_code2", ignore=shutil.ignore_patterns(STORE_DIR))
    folder = tmp_path / "data/ogbg_code2"
    rel, line = _edit_node_row({0: "99999"})(folder)
    argv = ["train", str(ROOT / "jobs" / "code2-local.yaml"), "--set", f"data.root={tmp_path / 'data'}",
            "--set", f"shards.root={tmp_path / 'shards'}", "--set", f"train.storage_path={tmp_path / 'ray'}"]
    code = (f"import sys; from pipeline.cli import main; rc = main({argv!r}); "
            "print([m for m in ('ray', 'torch') if m in sys.modules]); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "SATP_RUNS_DIR": str(tmp_path / "runs")})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith(f"satp: error: {folder / rel}: line {line}, graph 2: node type id 99999 outside "
                                  "[0, ") and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stdout.strip() == "[]"
    assert not (folder / STORE_DIR / STORE_FILE).exists() and not (tmp_path / "shards").exists()
