"""Small things the ``satp`` command says: a YAML error names where the unclosed construct opened; an
address where a web server answers is one line, without Ray's C++ warning; ``satp preprocess``
connects to Ray as every other command does (no token-authentication warning); counts agree with
their nouns."""
from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pipeline.cli import main
from tests.helpers import SESSION_CLUSTER_VARS

ROOT = Path(__file__).resolve().parents[1]


def test_a_yaml_error_names_where_the_bracket_opened(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("name: t\nmodel: {hidden_dim: 32,\n  num_layers: 2\ndata: {name: ogbg-ppa}\ntrain: {lr: 0.1}\n")
    assert main(["train", str(job)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"satp: error: {job}:4:5: not valid YAML: expected ',' or '}}', but got ':' "
                   "(while parsing a flow mapping opened at line 2, column 8)"], err


@pytest.mark.parametrize("value, says", [
    ("[1,", "not valid YAML (expected the node content, but found '<stream end>')"),
    ("!!python/object/apply:os.system [echo]", "the value carries the YAML tag !!python/object/apply:os.system"),
    ("!!str 3", "the value carries the YAML tag !!str"),
])
def test_a_set_value_that_is_not_plain_yaml_is_one_line(value, says, capsys):
    """``--set`` values go through YAML as a job file's do; one that does not parse, or that
    carries a tag, is one ``satp: error: --set KEY=VALUE: ...`` line, status 2 (was: a traceback)."""
    assert main(["train", str(ROOT / "jobs" / "code2-local.yaml"), "--set", f"train.lr={value}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"satp: error: --set train.lr={value}: {says}"), err


@pytest.fixture
def web_server():
    """An HTTP server on a free port of this machine: it answers, and it is not Ray."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_web_server_address_is_one_line_without_rays_warning(web_server, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(f"name: t\nmodel: {{}}\ndata: {{name: ogbg-ppa, root: {tmp_path / 'data'}}}\n")
    env = {k: v for k, v in os.environ.items() if k not in SESSION_CLUSTER_VARS}
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "preprocess", str(job), "--address", web_server],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"satp: error: cannot reach the Ray cluster at {web_server} (it answers, but not as a Ray cluster: it is "
        "an HTTP server; a dashboard address is for satp submit); start it (ray start --head) or leave --address "
        "out to run on a new local Ray"], proc.stderr
    assert not (tmp_path / "data").exists()


@pytest.mark.ray
def test_a_ray_cluster_passes_the_http2_check(ray_cluster):
    from runtime.ray_address import _grpc_problem, probe

    address = ray_cluster.get_runtime_context().gcs_address
    host, port = address.rsplit(":", 1)
    assert _grpc_problem(host, int(port), 5.0) is None
    probe(address)


def test_preprocess_starts_ray_as_every_command_does(tmp_path):
    """``satp preprocess`` started its local Ray with ``ray.init`` directly, and Ray printed its
    token-authentication warning; it goes through :func:`runtime.ray_cluster.connect` now (which
    starts a cluster without it). Checked where it calls: the first Ray task of a build."""
    code = ("import runtime.ray_cluster as cluster\n"
            "calls = []\n"
            "def connect(*args, **kwargs):\n"
            "    calls.append((args, kwargs)); raise SystemExit(7)\n"
            "cluster.connect = connect\n"
            "from preprocessing import DataConfig, ShardConfig, TransformConfig, preprocess\n"
            "from preprocessing.synthetic import build_synthetic_ppa\n"
            f"build_synthetic_ppa({str(tmp_path)!r}, 6)\n"
            "import atexit; atexit.register(lambda: print(calls))\n"
            f"preprocess(DataConfig(name='ogbg-ppa', root={str(tmp_path)!r}), TransformConfig(), "
            f"ShardConfig(root={str(tmp_path / 'shards')!r}), progress=False)\n")
    env = {k: v for k, v in os.environ.items() if k not in SESSION_CLUSTER_VARS}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 7, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[((None,), {'log_to_driver': False, 'dashboard': False})]"
    assert "Token authentication" not in proc.stderr


def test_counts_agree_with_their_nouns():
    from pipeline.console import plural

    assert [plural(n, "epoch") for n in (0, 1, 2)] == ["0 epochs", "1 epoch", "2 epochs"]


def test_a_reader_that_has_gone_ends_the_command_quietly_as_sigpipe_would(tmp_path):
    """``satp cluster status | head -1``: the pipe's reader has gone before the command writes; it ends
    with 141 (128 + SIGPIPE, as a shell reports) and says nothing (no error line, no traceback)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "pipeline.cli", "cluster", "status"], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=120,
                              env=dict(os.environ, SATP_HOME=str(tmp_path / "home")))
    finally:
        os.close(write_end)
    assert done.returncode == 141 and done.stderr == "", (done.returncode, done.stderr[-2000:])
