"""Messages a user reads, and what commands leave behind, one test per class of them.

* job-file mistakes: a misspelt section names the misspelling (not "model: Field required"),
  a YAML syntax error gives line and column;
* command inputs: ``satp data pycode`` names the files it skips and says so when every file
  fails; ``--out`` naming a file; ``models:/NAME`` without a version or alias;
* data: a corrupt shard is named when it is rebuilt; a failed download leaves no empty
  ``data.root``; a dataset that fails its checks leaves no OGB ``processed/`` cache;
* temporary files: loading a model leaves no PyG-generated module in ``$TMPDIR``;
* a healthy ``satp train`` with its output in files (not a terminal): no colour codes or
  progress bars, every epoch's metrics once, no token-auth warning, no error-level Ray line, no
  DeepSpeed op compiled, nothing left in ``$TMPDIR`` (``pymp-*``, generated modules).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from pipeline.cli import main
from tests.helpers import SESSION_CLUSTER_VARS, small_python_source
from tests.helpers import tiny_data, tiny_job_dict

ROOT = Path(__file__).resolve().parents[1]


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("satp: error: "), err
    return err[-1]


# ----------------------------------------------------------------------------- job files
def test_misspelt_section_and_yaml_syntax_error(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text("name: x\nmodle:\n  hidden_dim: 32\ndata: {name: ogbg-code2}\n")
    line = _error(capsys, ["train", str(path)])
    assert "modle: unknown key; did you mean 'model'?" in line and "Field required" not in line and "more" not in line
    path.write_text("name: x\ndata:\n  name: ogbg-code2\n   root: data\n")
    line = _error(capsys, ["train", str(path)])
    assert f"{path}:4:8: not valid YAML: mapping values are not allowed here" in line
    path.write_text("name: x\nmodel: {hiden_dim: 32}\ndata: {name: ogbg-code2, roots: x}\n")
    assert "did you mean 'root'?" in _error(capsys, ["train", str(path)])


# ----------------------------------------------------------------------------- command inputs
def test_pycode_names_skipped_files_and_every_file_failing(tmp_path, capsys):
    src = small_python_source(tmp_path / "src", ("json", "csv.py", "shlex.py"))
    (src / "broken.py").write_text("def f(:\n    pass\n")
    assert main(["data", "pycode", "--out", str(tmp_path / "d"), "--source", str(src)]) == 0
    err = capsys.readouterr().err
    assert "skipped 1 of" in err and f"{src / 'broken.py'}:1: SyntaxError" in err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.py").write_text("x = (\n")
    (bad / "b.py").write_text("def g(:\n")
    (bad / "c.py").write_text("class :\n")
    line = _error(capsys, ["data", "pycode", "--out", str(tmp_path / "e"), "--source", str(bad)])
    assert "none of the 3 Python file(s) parses" in line and "a.py:" in line
    assert not (tmp_path / "e").exists()


def test_out_naming_a_file(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    for builder in (["pycode"], ["synthetic-ppa", "--graphs", "5"]):
        line = _error(capsys, ["data", *builder, "--out", str(tmp_path / "file")])
        assert f"{tmp_path / 'file'}: not a directory" in line and "Errno" not in line
    line = _error(capsys, ["data", "pycode", "--out", str(tmp_path / "file" / "below")])
    assert f"({tmp_path / 'file'} is a file)" in line


def test_model_uri_without_version_or_alias(tmp_path, capsys):
    (tmp_path / "x.py").write_text("def f():\n    return 1\n")
    line = _error(capsys, ["predict", "models:/sat-code2", str(tmp_path / "x.py"),
                           "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"])
    assert "models:/sat-code2: name a version or an alias: models:/sat-code2/<version> or models:/sat-code2@champion" in line
    assert not (tmp_path / "mlflow.db").exists()


# ----------------------------------------------------------------------------- data
@pytest.mark.ray
def test_corrupt_shard_is_named_when_rebuilt(ray_cluster, tmp_path, capsys):
    from preprocessing import DataConfig, ShardConfig, TransformConfig, preprocess

    data = DataConfig(name="ogbg-ppa", root=str(tmp_path / "data"), source="synthetic", synthetic_graphs=30)
    transform, shards = TransformConfig(rwpe_steps=2, k_hops=0), ShardConfig(root=str(tmp_path / "shards"), graphs_per_shard=8)
    out = preprocess(data, transform, shards, progress=False)
    shard = out / "train-00001.arrow"
    payload = bytearray(shard.read_bytes())
    payload[len(payload) // 2] ^= 0xFF
    shard.write_bytes(bytes(payload))
    capsys.readouterr()
    preprocess(data, transform, shards, progress=False)
    err = capsys.readouterr().err
    assert f"rebuilding shard {shard}: its sha256 differs from the recorded one (corrupt)" in err
    assert err.count("rebuilding shard") == 1


def test_failed_download_leaves_no_empty_data_root(tmp_path, monkeypatch):
    import ogb.graphproppred.dataset_pyg as ogb_pyg

    from preprocessing.config import DataConfig
    from tests.helpers import load_source

    def no_network(url, folder, *args, **kwargs):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / url.rpartition("/")[2]).write_bytes(b"PK\x03\x04 partial")  # what a cut download leaves
        raise OSError("<urlopen error no network>")

    monkeypatch.setattr(ogb_pyg, "download_url", no_network)
    root = tmp_path / "new-root"
    with pytest.raises(ValueError, match="could not download ogbg-ppa"):
        load_source(DataConfig(name="ogbg-ppa", root=str(root)))
    assert not root.exists()
    root.mkdir()
    with pytest.raises(ValueError, match="could not download ogbg-ppa"):
        load_source(DataConfig(name="ogbg-ppa", root=str(root)))
    assert root.is_dir() and not any(root.iterdir())  # a root that existed stays, without the partial zip


def test_dataset_failing_its_checks_leaves_no_finished_store(tmp_path):
    import gzip

    from preprocessing.config import DataConfig
    from tests.helpers import load_source
    from preprocessing.synthetic import build_synthetic_ppa

    build_synthetic_ppa(tmp_path, 12, seed=0)
    edges = tmp_path / "ogbg_ppa" / "raw" / "edge.csv.gz"
    with gzip.open(edges, "rt") as fh:
        lines = fh.read().splitlines()
    with gzip.open(edges, "wt") as fh:
        fh.write("\n".join(["0,100000"] + lines[1:]) + "\n")  # an edge id out of range: ogb loads it, satp rejects it
    with pytest.raises(ValueError, match="outside"):
        load_source(DataConfig(name="ogbg-ppa", root=str(tmp_path)))
    store = tmp_path / "ogbg_ppa" / "columnar"
    assert not (store / "store.json").exists() and not (store / "edge_index.arrow").exists()


# ----------------------------------------------------------------------------- temporary files
def test_model_build_and_load_leave_no_generated_module(tmp_path):
    code = """
import pickle, sys
from pipeline import pyg_templates
pyg_templates.install()
import sat
model = sat.SAT(sat.SATConfig(hidden_dim=16, num_heads=4, edge_encoder="linear", edge_in_dim=2, gnn_type="gcn"))
pickle.loads(pickle.dumps(model))  # unpickling builds the convs again (as mlflow.pytorch.load_model does)
import inspect, torch_geometric.nn as nn
assert "def propagate" in inspect.getsource(type(nn.GCNConv(4, 4)).propagate)  # the source stays readable
"""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=dict(os.environ, TMPDIR=str(tmp)))
    assert out.returncode == 0, out.stderr[-2000:]
    assert not list(tmp.glob("*_propagate_*.py")), list(tmp.iterdir())


# ----------------------------------------------------------------------------- terminal output
def _stderr_on_a_terminal(code: str) -> str:
    """What ``code`` writes to its standard error when that is a terminal (a pseudo-terminal)."""
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 100-column terminal
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=follower, cwd=ROOT,
                            env={k: v for k, v in os.environ.items() if k not in ("TQDM_DISABLE", "RAY_COLOR_PREFIX")})
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    proc.wait(timeout=60)
    os.close(leader)
    return b"".join(chunks).decode(errors="replace")


def test_no_progress_silences_library_bars_and_files_get_no_colour(tmp_path):
    """``--no-progress`` reaches bars drawn by libraries (OGB's tqdm), not only satp's own; a log
    file gets no colour codes."""
    bar = ("from pipeline import console; console.setup(progress={}); import tqdm; "
           "[None for _ in tqdm.tqdm(range(3), desc='ogb-like')]")
    assert "ogb-like" in _stderr_on_a_terminal(bar.format(True))
    assert "ogb-like" not in _stderr_on_a_terminal(bar.format(False))
    log = tmp_path / "log.txt"
    code = ("import sys; from pipeline import console; console.setup(); "
            r"sys.stderr.write('\x1b[36m(RayTrainWorker pid=1)\x1b[0m epoch 0\n')")
    with log.open("w") as fh:
        done = subprocess.run([sys.executable, "-c", code], stderr=fh, stdout=subprocess.PIPE, cwd=ROOT, timeout=60)
    assert done.returncode == 0, log.read_text()
    assert log.read_text() == "(RayTrainWorker pid=1) epoch 0\n"


# ----------------------------------------------------------------------------- a healthy run, logged to files
@pytest.mark.slow
def test_healthy_train_run_logged_to_files(tmp_path, tmp_path_factory):
    """``satp train`` as a user runs it (its own local Ray with dashboard), stdout and stderr to files."""

    base = tmp_path_factory.getbasetemp() / "satp-tiny"
    base.mkdir(exist_ok=True)
    values = tiny_job_dict(base, run_name="files", epochs=2, train_subset=300, eval_subset=100,
                           storage_path=str(tmp_path / "ray"))
    values["resources"]["num_workers"] = 1
    values["mlflow"]["tracking_uri"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tiny_data(base)  # the shards, built once per session (shared with the other tests of the tiny job)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(values))
    tmp = Path(tempfile.mkdtemp(prefix="satpt", dir="/tmp"))  # short: Ray's sockets go below it (107 bytes)
    env = dict(os.environ, TMPDIR=str(tmp))
    for key in (*SESSION_CLUSTER_VARS, "RAY_AUTH_MODE", "RAY_COLOR_PREFIX", "TQDM_DISABLE"):
        env.pop(key, None)
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "train", str(job)], stdout=out, stderr=err,
                              env=env, cwd=ROOT, timeout=900)
    text = (tmp_path / "out.txt").read_text() + (tmp_path / "err.txt").read_text()
    assert proc.returncode == 0, text[-4000:]
    assert "\x1b[" not in text and "\r" not in text  # no colour codes, no redrawn progress bars
    assert len(re.findall(r"epoch 0: \{", text)) == 1 and len(re.findall(r"epoch 1: \{", text)) == 1
    assert "Reporting training result" not in text
    assert "Token authentication" not in text
    assert not re.search(r"\d{2}:\d{2}:\d{2},\d+ E \d+ \d+\]", text), "an error-level Ray line on a healthy run"
    assert "built successfully" not in text and "torch_extensions" not in text  # no DeepSpeed op compiled
    assert "registered model: models:/sat-tiny/" in text
    leftovers = [p.name for p in tmp.iterdir() if p.name.startswith(("pymp-", "satp-ray-")) or "_propagate_" in p.name]
    shutil.rmtree(tmp, ignore_errors=True)
    assert not leftovers, leftovers
