"""Ctrl-C and SIGTERM sent to the real ``satp train`` process, and the rerun after them.

The interrupt lands at a chosen point: right after a checkpoint's upload (the worker's
``ray.train.report`` returned), before or while Ray Train's controller registers it (test hook
``$SATP_TEST_FAULT``). The command runs against the session's local Ray cluster (``--address``).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import checkpoint_epochs, is_running, tiny_subset_job, tracebacks

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _satp_train(job: Path, address: str, fault: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "SATP_TEST_FAULT": json.dumps(fault) if fault else ""}
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "train", str(job), "--address", address, "--no-progress"],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_ctrl_c_keeps_the_newest_checkpoint_and_the_rerun_resumes_from_it(tiny_setting, tmp_path):
    from mlflow.tracking import MlflowClient

    from pipeline.train.checkpoint import CheckpointManager

    base, address = tiny_setting
    job = tiny_subset_job(base, tmp_path, "intr", epochs=3, checkpoints_to_keep=1)
    stopped = _satp_train(job, address, {"signal": "SIGINT", "epoch": 1, "marker": str(tmp_path / "fired")})
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    last = stopped.stderr.strip().splitlines()[-1]
    run_dir = tmp_path / "ray" / "intr"
    assert last.startswith("satp: interrupted (SIGINT): run intr kept its checkpoint of epoch 1"), last
    assert "the same command resumes after epoch 1" in last
    assert not tracebacks(stopped.stderr), stopped.stderr[-3000:]
    kept = checkpoint_epochs(run_dir)
    assert 1 in kept.values(), kept
    registered = CheckpointManager(run_dir).registered()
    print("registered by Ray before the interrupt:", {n: kept.get(n) for n in registered})

    resumed = _satp_train(job, address)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming run intr after epoch 1" in resumed.stderr
    # only what Ray keeps (checkpoints_to_keep: 1), nothing of the interrupted run left behind
    left = checkpoint_epochs(run_dir)
    assert list(left.values()) == [2] and set(left) == set(CheckpointManager(run_dir).registered())
    assert {p.name for p in run_dir.glob("checkpoint_*") if p.is_dir()} == set(left)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "val_f1")) == [0, 1, 2]
    assert run.info.status == "FINISHED"


def test_sigterm_ends_with_one_line_no_stack_dump_and_no_workers_left(tiny_setting, tmp_path):
    from ray.util.state import list_actors

    base, address = tiny_setting
    job = tiny_subset_job(base, tmp_path, "term", epochs=3)
    stopped = _satp_train(job, address, {"signal": "SIGTERM", "epoch": 0, "marker": str(tmp_path / "fired")})
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith("satp: interrupted (SIGTERM): run term kept its checkpoint of epoch 0"), last
    assert "SIGTERM received" not in stopped.stderr and not tracebacks(stopped.stderr), stopped.stderr[-3000:]
    # the driver's actors (Ray Train's controller and workers) end with it
    pids = {int(pid) for pid in re.findall(r"\((?:TrainController|RayTrainWorker) pid=(\d+)\)", stopped.stderr)}
    assert pids, "the run's actors print their pids"
    deadline = time.monotonic() + 60
    while [pid for pid in pids if is_running(pid)] and time.monotonic() < deadline:
        time.sleep(1)
    assert not [pid for pid in pids if is_running(pid)]


#: connects to the cluster at argv[1]; the SIGTERM arrives as Ray has started in the process (its
#: core worker runs) and ray.init's own handler is still in place, before satp's replaces it
SIGTERM_WHILE_CONNECTING = """
import os, signal, sys, time
import ray
from runtime import interrupts, ray_cluster
init = ray.init
def init_then_sigterm(**kwargs):
    init(**kwargs)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
ray.init = init_then_sigterm
try:
    ray_cluster.connect(sys.argv[1])
except interrupts.Interrupted as exc:
    time.sleep(5)  # an abort 3 s after the signal (the alarm of Ray's failure-signal handler) would end it here
    print(exc.signal_name)
    sys.exit(exc.exit_code)
"""


def test_a_sigterm_while_connecting_is_an_interrupt_without_stack_dump_or_abort(tiny_setting):
    _, address = tiny_setting
    done = subprocess.run([sys.executable, "-c", SIGTERM_WHILE_CONNECTING, address], capture_output=True, text=True,
                          timeout=300)
    assert (done.returncode, done.stdout) == (143, "SIGTERM\n"), done.stderr[-3000:]
    assert "SIGTERM received" not in done.stderr, done.stderr[-3000:]


#: a SIGTERM whose handler runs inside a finalizer (a weakref's callback), where Python drops what it raises
SIGTERM_IN_A_FINALIZER = """
import os, signal, time, weakref
from runtime import interrupts
interrupts.install()
class Held:
    pass
held = Held()
def callback(_):
    os.kill(os.getpid(), signal.SIGTERM)
    sum(range(1000))  # the handler has run by now (between two bytecodes)
reference = weakref.ref(held, callback)
try:
    del held
    time.sleep(30)
    print("not interrupted")
except interrupts.Interrupted as exc:
    print("interrupted:", exc.signal_name)
"""


def test_an_interrupt_a_finalizer_dropped_arrives_again():
    done = subprocess.run([sys.executable, "-c", SIGTERM_IN_A_FINALIZER], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.stdout == "interrupted: SIGTERM\n" and "Exception ignored" not in done.stderr, done.stderr
