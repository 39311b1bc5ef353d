"""Job submission to a local Ray cluster with the job server: the documented ``ray job submit``
line (entrypoint reads the job YAML) and ``satp submit JOB.yaml`` (Ray's JobSubmissionClient).

The module starts its own head node (``ray start --head --block``, dashboard on 127.0.0.1, token
auth disabled, its own ports and temp dir) and stops exactly the processes it started: never
``ray stop``, which would stop every Ray cluster on the machine.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from ray_nodes import NO_DRAIN
from runtime import forked_workers
from runtime.local_cluster import stop_processes
from runtime.ports import free_ports
from test_train_ray import tiny_data, tiny_job_dict

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def job_server():
    temp = tempfile.mkdtemp(prefix="satpj", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    gcs, dash, client, agent_http, agent_grpc, metrics, rt_env, nm, om = free_ports(9)
    fork_socket = str(Path(temp) / forked_workers.SOCKET_NAME)  # the node's fork server (docs/scale.md)
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", OUTDATED_IGNORE="1",
               DS_ACCELERATOR="cpu", PATH=f"{BIN}:{os.environ.get('PATH', '')}",
               **{forked_workers.SOCKET_VAR: fork_socket}, **NO_DRAIN)
    env.pop("RAY_ADDRESS", None)
    subprocess.Popen([sys.executable, "-m", "runtime.forked_workers", "--serve", fork_socket], env=env, cwd=ROOT,
                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    cmd = [str(BIN / "ray"), "start", "--head", "--block", "--num-cpus=2", "--node-ip-address=127.0.0.1",
           "--dashboard-host=127.0.0.1", f"--port={gcs}", f"--dashboard-port={dash}",
           f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent_http}",
           f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
           f"--runtime-env-agent-port={rt_env}", f"--node-manager-port={nm}", f"--object-manager-port={om}",
           f"--temp-dir={temp}", "--disable-usage-stats"]
    log = open(Path(temp) / "ray-start.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                urllib.request.urlopen(f"{address}/api/version", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("the test Ray head node did not start: " + (Path(temp) / "ray-start.log").read_text()[-2000:])
                time.sleep(1)
        yield address, env
    finally:
        stop_processes(temp)  # as satp cluster stop does: Ray's monitor and raylet first (all at once: ~10 s)
        proc.wait(timeout=30)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    base = tmp_path_factory.getbasetemp() / "satp-tiny"
    base.mkdir(exist_ok=True)
    return base, tiny_data(base)


def _job_file(directory: Path, base: Path, name: str) -> Path:
    values = tiny_job_dict(base, epochs=1, run_name=name, storage_path=str(directory / "ray"),
                           train_subset=300, eval_subset=100)
    values["resources"]["num_workers"] = 1
    values["mlflow"]["tracking_uri"] = f"sqlite:///{directory / 'mlflow.db'}"
    values["mlflow"]["registered_model"] = f"sat-{name}"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def _versions(directory: Path, name: str) -> list:
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{directory / 'mlflow.db'}").search_model_versions(f"name='{name}'")


@pytest.mark.ray
@pytest.mark.slow
def test_ray_job_submit_and_satp_submit_run_the_job_yaml(job_server, shards, tmp_path):
    address, env = job_server
    base, _ = shards
    cli_dir, wrap_dir = tmp_path / "cli", tmp_path / "wrapped"
    cli_job, wrap_job = _job_file(cli_dir, base, "via-cli"), _job_file(wrap_dir, base, "via-satp")
    # the README's form: Ray's CLI, the project as working dir, the entrypoint reads the YAML
    ray_cli = subprocess.Popen(
        [str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", str(ROOT), "--",
         "python", "-m", "pipeline.cli", "train", str(cli_job)],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # the one-argument form (run concurrently: the cluster has a CPU for each)
    wrapped = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "submit", str(wrap_job), "--address", address,
         "--working-dir", str(wrap_dir)],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out_cli, _ = ray_cli.communicate(timeout=400)
    out_wrapped, _ = wrapped.communicate(timeout=400)
    assert ray_cli.returncode == 0, out_cli[-3000:]
    assert wrapped.returncode == 0, out_wrapped[-3000:]
    assert "registered model: models:/sat-via-cli/1" in out_cli
    assert "registered model: models:/sat-via-satp/1" in out_wrapped  # logs were streamed
    assert "SUCCEEDED" in out_wrapped
    # the job's driver has the node's environment, which names the node's fork server
    assert "(forked worker process)" in out_cli and "(forked worker process)" in out_wrapped
    assert len(_versions(cli_dir, "sat-via-cli")) == 1 and len(_versions(wrap_dir, "sat-via-satp")) == 1


@pytest.mark.ray
def test_satp_submit_exits_nonzero_when_the_job_fails(job_server, shards, tmp_path):
    address, env = job_server
    base, _ = shards
    job = _job_file(tmp_path / "failing", base, "failing")
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "submit", str(job), "--address", address,
         "--working-dir", str(tmp_path / "failing"), "--set", "data.source=ogb",
         "--set", f"data.root={tmp_path / 'nowhere'}"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "FAILED" in proc.stdout


def test_satp_submit_rejects_a_bad_job_before_submitting(tmp_path, capsys):
    from pipeline.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"name": "x", "data": {"name": "ogbg-code2"}, "model": {}, "train": {"epochs": 0}}))
    # unreachable address: the job is rejected locally before any connection is tried
    assert main(["submit", str(bad), "--address", "http://127.0.0.1:9", "--working-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "train.epochs" in err and err.count("\n") == 1


# ----------------------------------------------------------------------------- what is uploaded (issue 30, defect 6)
BIG = 110 * 2**20  # over the 100 MiB Ray's job server takes in one upload


def _sparse(path: Path, size: int = BIG) -> None:
    """A file of ``size`` zero bytes that takes no disk space (Ray reads and zips all of them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.truncate(size)


def _project(directory: Path, base: Path, data_root: str) -> Path:
    """A working directory holding a job whose data root is ``data_root`` (relative to it)."""
    values = tiny_job_dict(base, epochs=1, storage_path=str(directory / "ray"))
    values["data"]["root"] = data_root
    values["resources"]["num_workers"] = 1
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def test_an_upload_over_rays_limit_is_refused_before_uploading(tmp_path, capsys):
    from pipeline.cli import main

    job = _project(tmp_path / "wd", tmp_path, "datasets")
    _sparse(tmp_path / "wd" / "notes" / "recording.bin")
    _sparse(tmp_path / "wd" / "datasets" / "ogbg_code2" / "raw" / "edge.csv.gz")  # the job's data: left out
    # an address where nothing listens: the size is checked before any connection
    argv = ["submit", str(job), "--address", "http://127.0.0.1:9", "--working-dir", str(tmp_path / "wd")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"satp: error: {tmp_path / 'wd'}: 110.0 MiB to upload"), err
    assert "over the 100.0 MiB Ray's job server accepts; biggest: notes/ 110.0 MiB" in err[0]
    assert f"{tmp_path / 'wd' / '.rayignore'} (gitignore syntax, e.g. /notes/)" in err[0]
    (tmp_path / "wd" / ".rayignore").write_text("/notes/\n")  # as the line says: now it goes on to connect
    assert main(argv) == 2
    assert "cannot reach the Ray job server at http://127.0.0.1:9" in capsys.readouterr().err


def test_job_excludes_name_the_jobs_folders_inside_the_working_dir(tmp_path):
    from pipeline.cli.submit import job_excludes
    from pipeline.config import load_job

    job = load_job(_project(tmp_path / "wd", tmp_path, "datasets"),
                   ["shards.root=cache/shards", f"mlflow.tracking_uri=sqlite:///{tmp_path / 'wd' / 'm' / 'x.db'}"])
    assert job_excludes(job, (tmp_path / "wd").resolve()) == ["/datasets", "/cache/shards", "/ray", "/m/x.db"]


@pytest.mark.ray
def test_satp_submit_leaves_the_jobs_data_out_of_the_upload(job_server, tmp_path):
    """The issue's reproduction: a working directory over 100 MB because of the job's data (here
    under a name no default exclude knows) got Ray's 413 traceback; its data now stay out."""
    from ray.job_submission import JobSubmissionClient

    from pipeline.cli.submit import submit

    address, env = job_server
    job = _project(tmp_path / "wd", tmp_path, "datasets")
    _sparse(tmp_path / "wd" / "datasets" / "ogbg_code2" / "raw" / "edge.csv.gz")
    out = __import__("io").StringIO()
    assert submit(job, address=address, wait=False, working_dir=tmp_path / "wd", out=out) == 0
    job_id = out.getvalue().split()[1]
    JobSubmissionClient(address).stop_job(job_id)  # only the upload mattered here
