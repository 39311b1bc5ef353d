"""`satp data pycode --environment`: source discovery (reserved projects left out, deterministic,
one project per top-level name) and the bounded-memory build (same bytes as the in-memory one)."""
from __future__ import annotations

import gzip
import hashlib
import io
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import preprocessing.pycode as pycode
from preprocessing.ogb_layout import assign_groups, write_gz_array, write_gz_text, write_splits
from preprocessing.pycode import build_pycode
from preprocessing.source_files import RESERVED_PROJECTS, environment_files, source_items
from tests.helpers import small_python_source

FN = "def {name}(x):\n    return x + 1\n"


def _write(path: Path, text: str = FN.format(name="get_value")) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _fake_site_packages(root: Path) -> Path:
    """A site-packages with normal packages, the four reserved ones (one as a module, one with a
    distribution that installed a second top-level module) and junk."""
    _write(root / "alpha" / "__init__.py")
    _write(root / "alpha" / "core.py")
    _write(root / "alpha" / "tests" / "test_core.py", FN.format(name="test_core"))  # tests are kept
    _write(root / "beta.py")
    _write(root / "gamma" / "sub" / "deep.py")
    _write(root / "jedi" / "__init__.py")
    _write(root / "IPython" / "core" / "shell.py")  # case-insensitive
    _write(root / "docutils.py")
    _write(root / "hypothesis" / "__init__.py")
    _write(root / "_hypothesis_globals.py")  # installed by hypothesis' distribution (RECORD)
    record = "hypothesis/__init__.py,,\n_hypothesis_globals.py,,\nhypothesis-6.0.dist-info/RECORD,,\n"
    _write(root / "hypothesis-6.0.dist-info" / "METADATA", "Metadata-Version: 2.1\nName: hypothesis\nVersion: 6.0\n")
    _write(root / "hypothesis-6.0.dist-info" / "RECORD", record)
    _write(root / "hypothesis-6.0.dist-info" / "top_level.txt", "hypothesis\n_hypothesis_globals\n")
    _write(root / "alpha-1.0.dist-info" / "METADATA", "Metadata-Version: 2.1\nName: alpha\nVersion: 1.0\n")
    _write(root / "numpy.libs" / "junk.py")  # not importable as a top-level name
    _write(root / "__pycache__" / "beta.py")
    _write(root / ".hidden" / "x.py")
    _write(root / "__editable___alpha_1_0_finder.py")
    (root / "alpha" / "data.txt").write_text("not python\n")
    return root


def test_environment_files_leave_out_reserved_projects_and_junk(tmp_path):
    site = _fake_site_packages(tmp_path / "site-packages")
    items = environment_files([site])
    rel = [str(r) for _, r, _ in items]
    assert rel == ["alpha/__init__.py", "alpha/core.py", "alpha/tests/test_core.py", "beta.py", "gamma/sub/deep.py"]
    assert [g for _, _, g in items] == ["alpha", "alpha", "alpha", "beta", "gamma"]
    assert all(p == site / r for p, r, _ in items)
    assert {name.lower() for name in RESERVED_PROJECTS} == {"jedi", "docutils", "hypothesis", "ipython"}


def test_environment_files_deterministic_grouped_and_without_duplicate_roots(tmp_path):
    std = tmp_path / "lib"
    _write(std / "json" / "__init__.py")
    _write(std / "json" / "tests" / "test_json.py", FN.format(name="test_json"))
    _write(std / "shlex.py")
    _write(std / "config-3.11-x86_64-linux-gnu" / "python-config.py")  # junk in a stdlib
    site = _fake_site_packages(std / "site-packages")  # a site-packages inside the standard library
    nested = std / "extra"  # a root nested in another root under another name
    _write(nested / "delta" / "__init__.py")
    roots = [std, site, site, nested]
    first = environment_files(roots)
    assert first == environment_files(roots)
    groups = Counter(g for _, _, g in first)
    assert groups == {"json": 2, "shlex": 1, "alpha": 3, "beta": 1, "gamma": 1, "delta": 1}  # no "extra", no repeats
    paths = [p for p, _, _ in first]
    assert len(paths) == len(set(paths))
    # sorted walk: roots in order, then sorted entries
    assert [str(r) for _, r, _ in first[:3]] == ["json/__init__.py", "json/tests/test_json.py", "shlex.py"]


def test_environment_build_same_bytes_for_any_workers(tmp_path):
    site = small_python_source(tmp_path / "site", ("json", "csv.py", "shlex.py", "textwrap.py"))
    shutil.copytree(site / "json", site / "jedi")  # real code under a reserved name: must not appear
    shutil.copy2(site / "shlex.py", site / "IPython.py")
    assert len(pycode._chunks(environment_files([site]), 3)) >= 3  # so that 3 processes share the parsing
    summaries, digests = {}, {}
    for workers in (1, 3):
        out = tmp_path / f"out{workers}"
        summaries[workers] = build_pycode(out, environment=True, environment_dirs=[site], workers=workers)
        digests[workers] = _tree_digest(out / "ogbg_code2")
    assert summaries[1] == summaries[3] and digests[1] == digests[3]
    assert summaries[1]["projects"] == 4
    with gzip.open(tmp_path / "out1/ogbg_code2/mapping/graphidx2source.csv.gz", "rt") as fh:
        projects = {line.split(",")[1] for line in fh.read().splitlines()[1:]}
    assert projects == {"json", "csv", "shlex", "textwrap"}
    with pytest.raises(ValueError, match="exclude each other"):
        build_pycode(tmp_path / "x", sources=[site], environment=True)


def test_bounded_build_matches_the_in_memory_build(tmp_path, monkeypatch):
    """One part per file (many parts), and the statistics against a direct count."""
    src = small_python_source(tmp_path / "src")
    (src / "broken_mod.py").write_text("def f(:\n")
    monkeypatch.setattr(pycode, "_CHUNK_BYTES", 1)
    summary = build_pycode(tmp_path / "new", [src], workers=2)
    _reference_build(tmp_path / "ref", src)
    assert _tree_digest(tmp_path / "new/ogbg_code2") == _tree_digest(tmp_path / "ref/ogbg_code2")

    graphs, failed, _ = collect_functions([src])
    nodes = [len(g.types) for g in graphs]
    names = Counter(" ".join(g.label) for g in graphs)
    assert summary["graphs"] == len(graphs) and summary["files_failed"] == len(failed) == 1
    assert summary["max_nodes"] == max(nodes) and summary["avg_nodes"] == round(sum(nodes) / len(nodes), 1)
    assert summary["method_names"] == len(names)
    assert summary["subtokens"] == len({t for g in graphs for t in g.label})
    assert summary["name_subtokens_mean"] == round(sum(len(g.label) for g in graphs) / len(graphs), 3)
    assert summary["names_up_to_5_subtokens"] == round(sum(len(g.label) <= 5 for g in graphs) / len(graphs), 4)
    assert 0 < summary["top5000_train_coverage"] <= 1


def test_cli_environment_flag(tmp_path, capsys):
    from pipeline.cli import main

    with pytest.raises(SystemExit) as info:
        main(["data", "pycode", "--out", str(tmp_path / "o"), "--environment", "--source", str(tmp_path)])
    assert info.value.code == 2 and "not allowed with" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["data", "pycode", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--environment" in help_text and "jedi, docutils, hypothesis and IPython" in help_text


# ----------------------------------------------------------------------------- helpers
def collect_functions(sources: list[Path]):
    """Every graph of the files, in memory, with its project and path: ``(graphs, parse failures, files read)``."""
    items = source_items([Path(s) for s in sources], False)
    parsed = [pycode._parse_file(item) for item in items]
    for (_, rel, group), (graphs, _) in zip(items, parsed):
        for g in graphs:
            g.group, g.path = group, str(rel)
    return [g for graphs, _ in parsed for g in graphs], [r for _, r in parsed if r is not None], len(parsed)


def _tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _reference_build(root: Path, src: Path) -> None:
    """The build as it was before it streamed (every graph in memory, whole arrays written)."""
    import csv

    graphs, _, _ = collect_functions([src])
    group_split = assign_groups(dict(Counter(g.group for g in graphs)), (0.8, 0.1, 0.1))
    split_of = np.array([group_split[g.group] for g in graphs])
    split_ids = {s: np.flatnonzero(split_of == s) for s in ("train", "valid", "test")}
    types_c, attrs_c = Counter(), Counter()
    for gid in split_ids["train"]:
        types_c.update(graphs[gid].types)
        attrs_c.update(a for a in graphs[gid].attrs if a is not None)

    def ranked(counts, limit):
        return [k for k, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]]

    types = ranked(types_c, 97) + ["__UNK__"]
    attrs = ranked(attrs_c, 10028) + ["__UNK__", "__NONE__"]
    t_idx, a_idx = {t: i for i, t in enumerate(types)}, {a: i for i, a in enumerate(attrs)}
    feat = [(t_idx.get(t, t_idx["__UNK__"]), a_idx["__NONE__"] if a is None else a_idx.get(a, a_idx["__UNK__"]))
            for g in graphs for t, a in zip(g.types, g.attrs)]
    edges = [(g.parent[i], i) for g in graphs for i in range(1, len(g.types))]
    n = [len(g.types) for g in graphs]
    folder = root / "ogbg_code2"
    raw = folder / "raw"
    write_gz_array(raw / "edge.csv.gz", np.asarray(edges).reshape(-1, 2))
    write_gz_array(raw / "node-feat.csv.gz", np.asarray(feat).reshape(-1, 2))
    write_gz_array(raw / "node_is_attributed.csv.gz", np.asarray([int(a is not None) for g in graphs for a in g.attrs]))
    write_gz_array(raw / "node_dfs_order.csv.gz", np.concatenate([np.arange(k) for k in n]))
    write_gz_array(raw / "node_depth.csv.gz", np.asarray([d for g in graphs for d in g.depth]))
    write_gz_array(raw / "num-node-list.csv.gz", np.asarray(n))
    write_gz_array(raw / "num-edge-list.csv.gz", np.asarray(n) - 1)
    write_gz_text(raw / "graph-label.csv.gz", "\n".join(" ".join(g.label) for g in graphs) + "\n")
    write_splits(folder, "ogbg-code2", split_ids)
    for name, header, values in (("typeidx2type", ("type idx", "type"), types),
                                 ("attridx2attr", ("attr idx", "attr"), attrs),
                                 ("graphidx2source", ("graph idx", "project", "path"), None)):
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(header)
        writer.writerows(enumerate(values) if values else ((i, g.group, g.path) for i, g in enumerate(graphs)))
        write_gz_text(folder / "mapping" / f"{name}.csv.gz", buf.getvalue())
    (folder / "RELEASE_v1.txt").write_text("satp offline build of OGB's raw layout, version 1\n")


def test_fewer_than_three_modules_are_refused_before_any_file_is_parsed(tmp_path):
    """The project split needs three top-level modules; their count is known from the file names,
    so ``--source DIR`` with two is refused at once, not after parsing every file (38 s for one
    15 MB file). One of the two is a named pipe with no writer: reading it, as parsing would, never
    returns, so the command ends (within its timeout) only if it refused before opening any file."""
    import os
    import subprocess
    import sys

    src = tmp_path / "src"
    _write(src / "alpha" / "core.py")
    os.mkfifo(src / "beta.py")
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "data", "pycode", "--source", str(src), "--out",
                           str(tmp_path / "out"), "--workers", "1"], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"satp: error: {src}: found 2 top-level module(s); the project split needs at least 3"), done.stderr[-2000:]
    assert not (tmp_path / "out" / "ogbg_code2").exists()
