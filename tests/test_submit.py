"""Job submission to a local Ray cluster with the job server: the documented ``ray job submit``
line (entrypoint reads the job YAML) and ``satp submit JOB.yaml`` (Ray's JobSubmissionClient): its
pre-flight before the upload, its exit status, what it uploads, and the cluster it finds by itself.

The module starts its own head node (``ray start --head --block``, dashboard on 127.0.0.1, token
auth disabled, its own ports and temp dir) and, for the test of a satp cluster found without
``--address``, a satp cluster of its own (``satp cluster start``, in a ``SATP_HOME`` of its own);
it stops exactly the processes it started: never ``ray stop``, which would stop every Ray cluster on
the machine. Its commands and jobs have a ``SATP_HOME`` of their own, so that no satp cluster of
another test session on the machine is theirs.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from runtime import fork_server
from runtime.local_cluster import stop_processes
from runtime.ports import free_ports
from tests.helpers import SESSION_CLUSTER_VARS, tiny_data, tiny_job_dict, wait_until
from tests.ray_nodes import NO_DRAIN

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _wait_for_dashboard(address: str, alive, log: Path) -> None:
    """Until the dashboard at ``address`` answers over HTTP (an authentication error is an answer)
    and lists the head node alive (a submit right after ``ray start`` would find no node yet)."""
    from ray.util.state import list_nodes

    deadline = time.time() + 90
    while True:
        try:
            urllib.request.urlopen(f"{address}/api/version", timeout=2).read()
            if list_nodes(address=address, filters=[("state", "=", "ALIVE")]):
                return
        except urllib.error.HTTPError:
            return
        except Exception:  # not answering yet: OSError, the State API's errors
            pass
        if not alive() or time.time() > deadline:
            raise RuntimeError(f"the test's Ray head node did not start: {log.read_text()[-2000:]}")
        time.sleep(1)


@pytest.fixture(scope="module")
def job_server():
    temp = tempfile.mkdtemp(prefix="satpj", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    gcs, dash, client, agent_http, agent_grpc, metrics, rt_env, nm, om = free_ports(9)
    fork_socket = str(Path(temp) / fork_server.SOCKET_NAME)  # the node's fork server (docs/scale.md)
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", OUTDATED_IGNORE="1",
               DS_ACCELERATOR="cpu", PATH=f"{BIN}:{os.environ.get('PATH', '')}", SATP_HOME=str(Path(temp) / "home"),
               **{fork_server.SOCKET_VAR: fork_socket}, **NO_DRAIN)
    env.pop("RAY_ADDRESS", None)
    subprocess.Popen([sys.executable, "-m", "runtime.fork_server", "--serve", fork_socket], env=env, cwd=ROOT,
                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    cmd = [str(BIN / "ray"), "start", "--head", "--block", "--num-cpus=2", "--node-ip-address=127.0.0.1",
           "--dashboard-host=127.0.0.1", f"--port={gcs}", f"--dashboard-port={dash}",
           f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent_http}",
           f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
           f"--runtime-env-agent-port={rt_env}", f"--node-manager-port={nm}", f"--object-manager-port={om}",
           f"--temp-dir={temp}", "--disable-usage-stats"]
    log_path = Path(temp) / "ray-start.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        _wait_for_dashboard(address, lambda: proc.poll() is None, log_path)
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


def _git_project(directory: Path) -> str:
    """Make ``directory`` a git repository with one commit (a project's checkout); return the commit."""
    git = ["git", "-C", str(directory), "-c", "user.name=satp", "-c", "user.email=satp@example.invalid"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "job.yaml"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "job"], check=True)
    return subprocess.run(git + ["rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()


def _satp_submit(env: dict, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "submit", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _submission_ids(address: str) -> set[str]:
    from ray.job_submission import JobSubmissionClient

    return {job.submission_id for job in JobSubmissionClient(address).list_jobs()}


@pytest.fixture(scope="module")
def finished_runs(job_server, shards, tmp_path_factory):
    """The README's ``ray job submit`` form and ``satp submit`` of a job in a git checkout, run
    concurrently (the cluster has a CPU for each); their outputs, once both have ended."""
    address, env = job_server
    base, _ = shards
    top = tmp_path_factory.mktemp("finished")
    cli_dir, wrap_dir = top / "cli", top / "wrapped"
    cli_job, wrap_job = _job_file(cli_dir, base, "via-cli"), _job_file(wrap_dir, base, "via-satp")
    commit = _git_project(wrap_dir)
    ray_cli = subprocess.Popen(
        [str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", str(ROOT), "--",
         "python", "-m", "pipeline.cli", "train", str(cli_job)],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wrapped = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "submit", str(wrap_job), "--address", address,
         "--working-dir", str(wrap_dir)],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out_cli, _ = ray_cli.communicate(timeout=400)
    out_wrapped, err_wrapped = wrapped.communicate(timeout=400)
    return {"cli": (ray_cli.returncode, out_cli, cli_dir), "commit": commit,
            "wrapped": (wrapped.returncode, out_wrapped, err_wrapped, wrap_dir, wrap_job)}


@pytest.mark.ray
@pytest.mark.slow
def test_ray_job_submit_and_satp_submit_run_the_job_yaml(finished_runs):
    rc_cli, out_cli, cli_dir = finished_runs["cli"]
    rc_wrapped, out_wrapped, err_wrapped, wrap_dir, _ = finished_runs["wrapped"]
    assert rc_cli == 0, out_cli[-3000:]
    assert rc_wrapped == 0, out_wrapped[-3000:] + err_wrapped[-2000:]
    assert "registered model: models:/sat-via-cli/1" in out_cli
    assert "registered model: models:/sat-via-satp/1" in out_wrapped  # logs were streamed
    assert "SUCCEEDED" in out_wrapped
    # the job's driver has the node's environment, which names the node's fork server
    assert "(forked worker process)" in out_cli and "(forked worker process)" in out_wrapped
    assert len(_versions(cli_dir, "sat-via-cli")) == 1 and len(_versions(wrap_dir, "sat-via-satp")) == 1


@pytest.mark.ray
@pytest.mark.slow
def test_a_successful_submit_adds_no_warning_and_no_setting_of_its_own(job_server, finished_runs):
    """What ``satp submit`` writes itself (its output less the job's log) holds no warning: Ray's
    upload warned of every default-excluded folder of a project (``.git``, ``.venv``) that satp leaves
    out anyway. The job's environment holds what the user can act on: the project directory its
    relative paths resolve against (a cluster on this machine) and the commit it records, no knobs."""
    from ray.job_submission import JobSubmissionClient

    address, _ = job_server
    rc, out, err, wrap_dir, _ = finished_runs["wrapped"]
    assert rc == 0, out[-3000:] + err[-2000:]
    job_id = re.search(r"^submitted (\S+) to ", out, re.M).group(1)
    client = JobSubmissionClient(address)
    job_lines = set(client.get_job_logs(job_id).splitlines())
    own = [line for line in out.splitlines() if line not in job_lines] + err.splitlines()
    assert own and not [line for line in own if "warn" in line.lower()], own
    env_vars = client.get_job_info(job_id).runtime_env["env_vars"]
    assert env_vars == {"SATP_WORKDIR": str(wrap_dir), "SATP_GIT_COMMIT": finished_runs["commit"]}


@pytest.mark.ray
@pytest.mark.slow
def test_a_job_failing_on_the_cluster_exits_with_its_own_status(job_server, finished_runs):
    """A run name that holds a checkpoint of another configuration is refused by ``satp train`` on
    the cluster (status 2, as it would be here): ``satp submit`` exits 2 too, not a blanket 1."""
    address, env = job_server
    _, _, _, wrap_dir, wrap_job = finished_runs["wrapped"]
    proc = _satp_submit(env, str(wrap_job), "--address", address, "--working-dir", str(wrap_dir),
                        "--set", "train.lr=0.001")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "holds a checkpoint of another configuration" in proc.stdout
    assert re.search(r"^job \S+: FAILED \(exit status 2\)$", proc.stdout, re.M), proc.stdout[-1000:]



def test_the_exit_status_of_a_job_that_ended_is_its_own():
    """The mapping of the command's help, on what Ray reports of a job (its ``JobDetails``)."""
    from ray.job_submission import JobDetails, JobStatus, JobType

    from pipeline.cli.submit import exit_status

    def ended(status, code=None, message=None):
        return exit_status(JobDetails(type=JobType.SUBMISSION, entrypoint="python -m pipeline.cli train job.yaml",
                                      status=status, driver_exit_code=code, message=message))

    assert ended(JobStatus.SUCCEEDED, 0) == (0, "")
    assert ended(JobStatus.FAILED, 2) == (2, " (exit status 2)")
    assert ended(JobStatus.FAILED, -15) == (143, " (exit status 143)")  # killed by SIGTERM
    assert ended(JobStatus.FAILED, None, "Failed to set up the runtime environment.\nTraceback") == \
        (1, ": Failed to set up the runtime environment.")
    assert ended(JobStatus.STOPPED, None, "Job was intentionally stopped.") == (1, ": Job was intentionally stopped.")

@pytest.mark.ray
def test_a_job_asking_for_more_workers_than_the_cluster_has_is_refused_before_upload(job_server, shards, tmp_path):
    """The cluster's nodes, asked through its dashboard, against the job's workers: refused here in
    one line with satp train's status 2, nothing uploaded or started (it failed on the cluster)."""
    address, env = job_server
    base, _ = shards
    job = _job_file(tmp_path / "many", base, "many")
    before = _submission_ids(address)
    proc = _satp_submit(env, str(job), "--address", address, "--working-dir", str(tmp_path / "many"),
                        "--set", "resources.num_workers=3", timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert len(err) == 1 and err[0].startswith("satp: error: resources: the job asks for 3 worker(s) x (1 CPU); "
                                               f"the Ray cluster at {address} has 2 CPU, 0 GPU on 1 node(s)"), err
    assert _submission_ids(address) == before


def _truncated_dataset(base: Path, root: Path) -> Path:
    """A copy of the tiny dataset under ``root`` (without its converted store) whose edge file is cut short."""
    from preprocessing.columnar import STORE_DIR
    from preprocessing.ogb_layout import OGB_DIR

    folder = root / OGB_DIR["ogbg-code2"]
    shutil.copytree(base / "data" / OGB_DIR["ogbg-code2"], folder, ignore=shutil.ignore_patterns(STORE_DIR))
    edges = folder / "raw" / "edge.csv.gz"
    os.truncate(edges, edges.stat().st_size // 2)
    return edges


@pytest.mark.ray
def test_a_job_whose_raw_data_is_truncated_is_refused_before_upload(job_server, shards, tmp_path):
    address, env = job_server
    base, _ = shards
    edges = _truncated_dataset(base, tmp_path / "data")
    job = _job_file(tmp_path / "cut", base, "cut")
    before = _submission_ids(address)
    proc = _satp_submit(env, str(job), "--address", address, "--working-dir", str(tmp_path / "cut"),
                        "--set", f"data.root={tmp_path / 'data'}", timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert err == [f"satp: error: {edges}: truncated (the gzip stream ends early)"], err
    assert _submission_ids(address) == before


def test_for_another_cluster_only_the_data_seen_here_are_checked(shards, tmp_path):
    """A cluster elsewhere has its own file system: a data root absent here is its own (not refused,
    nothing made here); a dataset folder at an absolute root that exists here (shared storage) is
    checked. For a cluster on this machine, every path is this machine's."""
    from pipeline.cli.submit import preflight
    from pipeline.config import load_job

    base, _ = shards
    path = _job_file(tmp_path / "wd", base, "elsewhere")
    _truncated_dataset(base, tmp_path / "shared")
    with pytest.raises(ValueError, match="truncated"):
        preflight(load_job(path, [f"data.root={tmp_path / 'shared'}"]), tmp_path / "wd", local=False)
    for root in ("/proc/nope", "datasets"):
        preflight(load_job(path, [f"data.root={root}"]), tmp_path / "wd", local=False)
    assert not (tmp_path / "wd" / "datasets").exists()
    with pytest.raises(ValueError, match="data.root: /proc/nope does not exist and cannot be created"):
        preflight(load_job(path, ["data.root=/proc/nope"]), tmp_path / "wd", local=True)


def test_satp_submit_rejects_a_bad_job_before_submitting(tmp_path, capsys):
    from pipeline.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"name": "x", "data": {"name": "ogbg-code2"}, "model": {}, "train": {"epochs": 0}}))
    # unreachable address: the job is rejected locally before any connection is tried
    assert main(["submit", str(bad), "--address", "http://127.0.0.1:9", "--working-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "train.epochs" in err and err.count("\n") == 1


# ----------------------------------------------------------------------------- the cluster it finds
def test_satp_submit_without_a_cluster_names_what_it_tried(shards, tmp_path, monkeypatch, capsys):
    from pipeline.cli import main

    base, _ = shards
    job = _job_file(tmp_path / "wd", base, "nowhere")
    monkeypatch.setenv("SATP_HOME", str(tmp_path / "home"))  # no satp cluster recorded there
    for key in SESSION_CLUSTER_VARS:
        monkeypatch.delenv(key, raising=False)
    assert main(["submit", str(job), "--working-dir", str(tmp_path / "wd")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["satp: error: no Ray job server to submit to: no --address, no $RAY_ADDRESS, and no satp cluster "
                   "runs on this machine; start one (satp cluster start) or name a cluster's job server "
                   "(--address http://HOST:8265)"], err


@pytest.mark.ray
def test_satp_submit_finds_the_satp_cluster_by_itself(shards, tmp_path):
    """Without ``--address`` and ``$RAY_ADDRESS``: the satp cluster of this machine (its job server
    is on a port of its own, not Ray's 8265), named in one line. The job's driver is forked by the
    cluster's fork server, with no warning in the job's log, though Ray put the job's upload on its
    ``PYTHONPATH`` (here the checkout's too, as a user who runs satp from a checkout has it)."""
    from ray.job_submission import JobSubmissionClient

    base, _ = shards
    env = dict(os.environ, SATP_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT),
               PATH=f"{BIN}:{os.environ.get('PATH', '')}", **NO_DRAIN)  # the job's `python` is this one
    for key in SESSION_CLUSTER_VARS:
        env.pop(key, None)
    job = _job_file(tmp_path / "wd", base, "found")
    start = subprocess.run([sys.executable, "-m", "pipeline.cli", "cluster", "start", "--num-cpus", "1"],
                           env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    try:
        assert start.returncode == 0, start.stdout + start.stderr
        dashboard = re.search(r"dashboard (http://127\.0\.0\.1:\d+)", start.stdout).group(1)
        proc = _satp_submit(env, str(job), "--working-dir", str(tmp_path / "wd"), "--no-wait", timeout=180)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        lines = proc.stdout.splitlines()
        assert lines[0] == f"satp submit: the satp cluster's job server at {dashboard} (satp cluster status)", lines
        job_id = re.fullmatch(rf"submitted (\S+) to {re.escape(dashboard)}: tiny", lines[1]).group(1)
        client = JobSubmissionClient(dashboard)
        assert client.get_job_info(job_id).entrypoint.endswith("train job.yaml")
        folder = Path(json.loads((tmp_path / "home" / "cluster.json").read_text())["folder"])
        server_log = folder / fork_server.LOG_NAME
        asked = r"^(forked pid \d+ for client pid \d+: train job\.yaml|refused command)"
        wait_until(lambda: re.search(asked, server_log.read_text(), re.M) or client.get_job_status(job_id).is_terminal(),
                   "the job's driver at the fork server", 300, every=0.5)
        client.stop_job(job_id)  # only its start mattered here
        wait_until(lambda: client.get_job_status(job_id).is_terminal(), "the job's end", 120, every=0.5)
        job_log = client.get_job_logs(job_id)
        assert re.search(asked, server_log.read_text(), re.M), job_log[-3000:]
        assert "refused" not in server_log.read_text(), server_log.read_text()
        assert "fork server did not run this command" not in job_log
    finally:
        stop = subprocess.run([sys.executable, "-m", "pipeline.cli", "cluster", "stop"], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
    assert stop.returncode == 0, stop.stdout + stop.stderr


# ----------------------------------------------------------------------------- what is uploaded
BIG = 110 * 2**20  # over the 100 MiB Ray's job server takes in one upload


def _sparse(path: Path, size: int = BIG) -> None:
    """A file of ``size`` zero bytes that takes no disk space (Ray reads and zips all of them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.truncate(size)


def _project(directory: Path, base: Path, data_root: str) -> Path:
    """A working directory holding a job whose data root is ``data_root`` (relative to it), where a
    big raw file lies in a dataset folder (not complete enough for its values to be checked)."""
    values = tiny_job_dict(base, epochs=1, storage_path=str(directory / "ray"))
    values["data"]["root"] = data_root
    values["resources"]["num_workers"] = 1
    folder = directory / data_root / "ogbg_code2"
    _sparse(folder / "raw" / "edge.csv.gz")
    (folder / "RELEASE_v1.txt").write_text("1\n")
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def test_an_upload_over_rays_limit_is_refused_before_uploading(tmp_path, capsys):
    from pipeline.cli import main

    job = _project(tmp_path / "wd", tmp_path, "datasets")  # the job's data: left out
    _sparse(tmp_path / "wd" / "notes" / "recording.bin")
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
    """A working directory over 100 MB because of the job's data (here under a name no default
    exclude knows) got Ray's 413 traceback; its data now stay out."""
    from ray.job_submission import JobSubmissionClient

    from pipeline.cli.submit import submit

    address, env = job_server
    job = _project(tmp_path / "wd", tmp_path, "datasets")
    out = __import__("io").StringIO()
    assert submit(job, address=address, wait=False, working_dir=tmp_path / "wd", out=out) == 0
    job_id = out.getvalue().split()[1]
    JobSubmissionClient(address).stop_job(job_id)  # only the upload mattered here
