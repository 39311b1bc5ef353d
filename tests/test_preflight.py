"""The pre-flight check (pipeline.train.preflight): what the driver can see fails before Ray starts or a
worker is launched, as one ``satp: error:`` line, for ``satp train`` and ``satp tune`` alike."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline.cli import main
from runtime.ports import free_ports
from tests.helpers import SESSION_CLUSTER_VARS

ROOT = Path(__file__).resolve().parents[1]
LOCAL_JOB = ROOT / "jobs" / "code2-local.yaml"
HEAVY = ("torch", "torch_geometric", "ray", "mlflow", "deepspeed", "ogb")


def _job(tmp_path: Path, edit=None) -> Path:
    raw = yaml.safe_load(LOCAL_JOB.read_text())
    raw["data"]["root"] = str(tmp_path / "data")
    raw["shards"]["root"] = str(tmp_path / "shards")
    raw["train"]["storage_path"] = str(tmp_path / "ray")
    raw["mlflow"]["tracking_uri"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    if edit:
        edit(raw)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("satp: error: "), err
    return err[0]


def _satp(args: list[str], tmp_path: Path, timeout: float = 300):
    env = dict(os.environ, SATP_RUNS_DIR=str(tmp_path / "runs"))
    for key in SESSION_CLUSTER_VARS:
        env.pop(key, None)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)
    return proc, time.monotonic() - start


# ----------------------------------------------------------------------------- start-up
def test_parser_and_job_validation_import_no_heavy_library():
    """`satp --help` and a job's validation errors need argparse, pydantic and PyYAML only
    (torch alone takes seconds to import)."""
    code = ("import sys; import pipeline.cli as c; c.build_parser(); from pipeline.config import load_job; "
            f"load_job({str(LOCAL_JOB)!r}); print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_help_comes_back_fast():
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "train" in out.stdout
    assert time.monotonic() - start < 10  # well under a second on an idle machine; generous for a busy one


# ----------------------------------------------------------------------------- the job alone
FEATURES = {
    "subgraph without k-hop indices": (
        lambda r: (r["model"].update(extractor="subgraph"), r["transform"].update(k_hops=0)),
        "model.extractor: 'subgraph' reads each node's k-hop subgraph indices"),
    "rwpe without rwpe": (
        lambda r: (r["model"].update(pe="rwpe", pe_dim=8), r["transform"].update(rwpe_steps=0)),
        "no rwpe encodings (transform.rwpe_steps: 0)"),
    "rwpe of another width": (
        lambda r: (r["model"].update(pe="rwpe", pe_dim=8), r["transform"].update(rwpe_steps=16)),
        "hold 16-wide rwpe encodings"),
    "laplacian pe without it": (
        lambda r: (r["model"].update(pe="lap", pe_dim=4), r["transform"].update(lap_pe_dim=0)),
        "model.pe: 'lap' with pe_dim 4"),
}


@pytest.mark.parametrize("case", sorted(FEATURES))
def test_model_against_shard_features_before_anything_starts(case, tmp_path, capsys):
    edit, expected = FEATURES[case]
    path = _job(tmp_path, edit)
    assert main(["train", str(path)]) == 2
    line = _one_line(capsys)
    assert expected in line, line
    assert not (tmp_path / "data").exists() and not (tmp_path / "ray").exists() and not (tmp_path / "mlflow.db").exists()


def test_model_against_existing_shards():
    from pipeline.train.preflight import check_shard_features
    from sat.config import SATConfig

    columns = {"x": {"shape": [-1, 2]}, "rwpe": {"shape": [-1, 4]}}
    with pytest.raises(ValueError, match="hold 4-wide rwpe encodings"):
        check_shard_features(SATConfig(pe="rwpe", pe_dim=8), {"columns": columns}, "/shards/x")
    with pytest.raises(ValueError, match="reads each node's k-hop subgraph indices"):
        check_shard_features(SATConfig(extractor="subgraph", k_hops=2), {"columns": columns}, "/shards/x")
    check_shard_features(SATConfig(pe="rwpe", pe_dim=4), {"columns": columns}, "/shards/x")


# ----------------------------------------------------------------------------- data root
def test_data_root_problems(tmp_path):
    from pipeline.config import load_job
    from pipeline.train.preflight import check_data_root

    (tmp_path / "a-file").write_text("")
    job = load_job(_job(tmp_path))
    with pytest.raises(ValueError, match="is a file; expected a directory"):
        check_data_root(job.data.model_copy(update={"root": str(tmp_path / "a-file")}))
    (tmp_path / "partial" / "ogbg_code2").mkdir(parents=True)
    with pytest.raises(ValueError, match="RELEASE_v1.txt missing"):
        check_data_root(job.data.model_copy(update={"root": str(tmp_path / "partial")}))
    with pytest.raises(ValueError, match="source directory not found"):
        check_data_root(job.data.model_copy(update={"source_dirs": [str(tmp_path / "no-such-source")]}))
    check_data_root(job.data)  # absent, buildable from this interpreter's standard library


def test_download_probe_reports_a_dead_address():
    from pipeline.train.preflight import _probe_download

    assert _probe_download(f"http://127.0.0.1:{free_ports(1)[0]}/code2.zip")  # refused: a reason, not None


# ----------------------------------------------------------------------------- Ray address
def test_unreachable_address_fails_within_seconds():
    """Refused, unroutable (or answered by something that is not Ray), and a listener that never
    answers: each is a one-line error within the probe's ~10 s, never ray.init's minute of retries."""
    from runtime.ray_address import probe

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)  # accepts connections into its backlog, says nothing
        for address in (f"127.0.0.1:{free_ports(1)[0]}", "10.255.255.1:6379", f"127.0.0.1:{silent.getsockname()[1]}"):
            start = time.monotonic()
            with pytest.raises(ValueError, match="cannot reach the Ray cluster at"):
                probe(address)
            assert time.monotonic() - start < 15, address


def test_train_with_a_dead_address_is_one_line_and_starts_no_ray(tmp_path):
    port = free_ports(1)[0]
    proc, seconds = _satp(["train", str(_job(tmp_path)), "--address", f"127.0.0.1:{port}"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("satp: error:")]
    assert len(errors) == 1 and f"cannot reach the Ray cluster at 127.0.0.1:{port}" in errors[0]
    assert "Ray instance" not in proc.stderr and "Traceback" not in proc.stderr
    assert seconds < 60  # the probe takes <= 5 s; the rest is importing torch


# ----------------------------------------------------------------------------- resources
def test_worker_slots_count_per_node():
    from pipeline.train.preflight import worker_slots

    nodes = [{"Alive": True, "Resources": {"CPU": 3.0, "GPU": 1.0}}, {"Alive": True, "Resources": {"CPU": 2.0}},
             {"Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}}]
    assert worker_slots(nodes, {"CPU": 1.0}) == 5
    assert worker_slots(nodes, {"CPU": 2.0}) == 2  # 3 CPUs hold one 2-CPU worker: no worker spans nodes
    assert worker_slots(nodes, {"CPU": 1.0, "GPU": 1.0}) == 1


def test_gpu_workers_on_a_machine_without_them_fail_before_ray_starts(tmp_path):
    """jobs/code2.yaml-like request (GPU workers) that this machine cannot hold: no autoscaler wait."""
    path = _job(tmp_path, lambda r: (r["resources"].update(num_workers=4, use_gpu=True, gpus_per_worker=64),
                                     r["train"].update(precision="bf16")))
    proc, seconds = _satp(["train", str(path)], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("satp: error:")]
    assert len(errors) == 1 and "4 worker(s) x (1 CPU, 64 GPU)" in errors[0] and "room for 0" in errors[0], errors
    assert "Ray instance" not in proc.stderr and not (tmp_path / "data").exists()
    assert seconds < 60


@pytest.mark.ray
def test_train_and_tune_share_the_preflight(ray_cluster, tmp_path):
    """The same check, with the connected cluster's numbers, from train_job and from a sweep."""
    from pipeline.config import load_job
    from pipeline.train.driver import train_job
    from pipeline.sweep.tune import run_sweep

    job = load_job(_job(tmp_path, lambda r: r["resources"].update(num_workers=2, cpus_per_worker=1000)))
    with pytest.raises(ValueError, match=r"2 worker\(s\) x \(1000 CPU\); .* has 2 CPU"):
        train_job(job)
    sweep = load_job(ROOT / "jobs" / "code2-sweep-local.yaml",
                     ["resources.cpus_per_worker=1000", f"data.root={tmp_path / 'data'}",
                      f"shards.root={tmp_path / 'shards'}", f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
                      f"tune.storage_path={tmp_path / 'tune'}"])
    with pytest.raises(ValueError, match=r"x \(1000 CPU\).* has 2 CPU"):
        run_sweep(sweep)
    assert not (tmp_path / "data").exists() and not (tmp_path / "tune").exists()


# ----------------------------------------------------------------------------- where a run writes
PROCFS = Path("/proc/self").is_dir()  # a directory where even root cannot create entries


@pytest.mark.parametrize("key", ["data.root", "shards.root", "train.storage_path"])
def test_a_directory_that_cannot_be_created_fails_in_the_preflight(key, tmp_path, capsys):
    """The report: ``data.root=/proc/nope`` passed the pre-flight, Ray started and after 37 s came
    ``[Errno 2] No such file or directory: '/proc/nope'``, naming no key. Now one line naming the
    key, the path and why, before Ray (a path under a file fails the same way on any system)."""
    (tmp_path / "a-file").write_text("")
    paths = [str(tmp_path / "a-file" / "nope")] + (["/proc/nope"] if PROCFS else [])
    for path in paths:
        assert main(["train", str(_job(tmp_path)), "--set", f"{key}={path}"]) == 2
        line = _one_line(capsys)
        assert line.startswith(f"satp: error: {key}: {path}") and ("cannot be created" in line or "is a file" in line), line
    assert not (tmp_path / "ray").exists() and not (tmp_path / "mlflow.db").exists()


def test_a_directory_that_can_be_created_is_left_as_it_was(tmp_path):
    from pipeline.train.preflight import check_writable_dir

    check_writable_dir("shards.root", tmp_path / "x" / "y" / "z")  # created and removed again
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "here").mkdir()
    check_writable_dir("shards.root", tmp_path / "here")
    assert list((tmp_path / "here").iterdir()) == []


@pytest.mark.skipif(not PROCFS, reason="needs Linux's /proc")
def test_the_reported_data_root_fails_in_seconds_without_ray(tmp_path):
    proc, seconds = _satp(["train", str(_job(tmp_path)), "--set", "data.root=/proc/nope"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("satp: error:")]
    assert errors == ["satp: error: data.root: /proc/nope does not exist and cannot be created "
                      "(mkdir /proc/nope: No such file or directory)"], proc.stderr[-2000:]
    assert "Ray instance" not in proc.stderr and "Traceback" not in proc.stderr
    assert seconds < 60  # the error comes before torch is imported; generous for a busy machine
