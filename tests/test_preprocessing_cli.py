"""`satp data pycode`, `satp data synthetic-ppa`, `satp preprocess`: outputs and one-line errors."""
from __future__ import annotations

import json

import pytest

from pipeline.cli import main
from preprocessing.reader import ShardDataset
from tests.helpers import small_python_source


def _job(tmp_path, body: str):
    path = tmp_path / "job.yaml"
    path.write_text(body)
    return path


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("satp: error: ")
    return err[0]


def test_data_builders(tmp_path, capsys):
    src = small_python_source(tmp_path / "src", ("json", "csv.py", "shlex.py"))
    assert main(["data", "pycode", "--out", str(tmp_path / "d"), "--source", str(src)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["graphs"] > 30 and summary["projects"] == 3
    assert (tmp_path / "d/ogbg_code2/RELEASE_v1.txt").is_file()
    assert "already exists" in _error(capsys, ["data", "pycode", "--out", str(tmp_path / "d"), "--source", str(src)])
    assert main(["data", "synthetic-ppa", "--out", str(tmp_path / "d"), "--graphs", "9"]) == 0
    assert json.loads(capsys.readouterr().out)["graphs"] == 9
    assert "--graphs" in _error(capsys, ["data", "synthetic-ppa", "--out", str(tmp_path / "e"), "--graphs", "1"])
    assert "source directory not found" in _error(
        capsys, ["data", "pycode", "--out", str(tmp_path / "f"), "--source", str(tmp_path / "nope")]
    )
    assert not (tmp_path / "f").exists() and not (tmp_path / "e").exists()


@pytest.mark.ray
def test_preprocess_command_with_overrides(tmp_path, capsys, ray_cluster):
    job = _job(tmp_path, f"""
name: t
model: {{}}
data:
  name: ogbg-ppa
  root: {tmp_path / 'data'}
  source: synthetic
  synthetic_graphs: 12
transform:
  rwpe_steps: 4
shards:
  root: {tmp_path / 'shards'}
""")
    assert main(["preprocess", str(job), "--set", "transform.k_hops=0", "--set", "shards.graphs_per_shard=5",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    ds = ShardDataset(out, "train")
    assert ds.manifest["config"]["transform"]["k_hops"] == 0 and ds.manifest["config"]["shards"]["graphs_per_shard"] == 5
    assert "subgraph_node_index" not in ds[0]


@pytest.mark.parametrize(
    "body,expected",
    [
        ("name: t\nmodel: {}\ndata: {name: ogbg-ppa, colour: red}\n", "data.colour: unknown key"),
        ("name: t\nmodel: {}\ndata: {name: ogbg-molhiv}\n", "data.name: Input should be 'ogbg-code2', 'ogbg-ppa', 'pattern' or 'cluster'"),
        ("name: t\nmodel: {}\ndata: {name: ogbg-ppa}\ntransform: {k_hops: two}\n", "transform.k_hops"),
        ("name: t\nmodel: {}\ndata: {name: ogbg-ppa}\nshards: {graphs_per_shard: 0}\n", "shards.graphs_per_shard"),
        ("name: t\nmodel: {}\ndata: {name: ogbg-ppa, source: pycode}\n", "builds ogbg-code2"),
    ],
)
def test_bad_job_yaml(tmp_path, capsys, body, expected):
    job = _job(tmp_path, body)
    line = _error(capsys, ["preprocess", str(job)])
    assert str(job) in line and expected in line


def test_missing_raw_file_via_cli(tmp_path, capsys):
    assert main(["data", "synthetic-ppa", "--out", str(tmp_path / "data"), "--graphs", "6"]) == 0
    (tmp_path / "data/ogbg_ppa/raw/graph-label.csv.gz").unlink()
    job = _job(tmp_path, f"name: t\nmodel: {{}}\ndata: {{name: ogbg-ppa, root: {tmp_path / 'data'}}}\n"
                         f"shards: {{root: {tmp_path / 'shards'}}}\n")
    line = _error(capsys, ["preprocess", str(job)])
    assert "graph-label.csv.gz: missing" in line and not (tmp_path / "shards").exists()


@pytest.mark.parametrize("key", ["data.root", "shards.root"])
def test_preprocess_checks_its_paths_before_torch_and_ray(tmp_path, key):
    """``--set data.root=/proc/nope`` answered after 10-17 s (Ray started, the
    dataset builder failed) with an error naming no key; now satp train's path checks run first."""
    import subprocess
    import sys
    from pathlib import Path

    job = _job(tmp_path, f"name: t\nmodel: {{}}\ndata: {{name: ogbg-ppa, root: {tmp_path / 'data'}, source: synthetic}}\n"
                         f"shards: {{root: {tmp_path / 'shards'}}}\n")
    code = ("import sys\nfrom pipeline.cli import main\nrc = main(sys.argv[1:])\n"
            "print(sorted(m for m in ('torch', 'ray', 'pyarrow') if m in sys.modules))\nsys.exit(rc)\n")
    proc = subprocess.run([sys.executable, "-c", code, "preprocess", str(job), "--set", f"{key}=/proc/nope"],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"satp: error: {key}: /proc/nope does not exist and cannot be created (mkdir /proc/nope: No such file or directory)"]
    assert proc.stdout.strip() == "[]"  # refused before torch, Ray or the data libraries were loaded
    assert not (tmp_path / "data").exists() and not (tmp_path / "shards").exists()
