"""An elastic run (``resources.num_workers: [1, 2]``) on a Ray cluster of several nodes on this
machine (:mod:`ray_nodes`): a head and node B of 1 CPU each, one worker per node.

One run answers the elastic path's questions: it starts at 2 workers; node B is lost (SIGKILL to all its
processes) while the workers write a step checkpoint, the rank there half-way through copying its
part (a test hook pauses it); the run goes on at 1 worker on the head from the checkpoint before,
without waiting for B; node C joins and the run grows back to 2 workers at its next resize check
(``resources.resize_check_s: 5``; the 1-worker group holds at step 11 until then, a test hook). A
fixed 2-worker run of the same job, first, is the reference:
the same global batches, so the same loss at every global step.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import tiny_job_dict, wait_until
from tests.ray_nodes import local_cluster

ROOT = Path(__file__).resolve().parents[1]
EVERY = 3  # train.checkpoint_every_steps
CUT = 2 * EVERY  # the step whose checkpoint node B's loss cuts short
HOLD = 3 * EVERY + 2  # the 1-worker group waits here for node C (whatever the machine's speed)


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(dict(os.environ), head_cpus=1) as nodes:
        yield nodes


def _job(base: Path, tiny_base: Path, run_name: str, workers) -> Path:
    """The tiny code2 job (tests.helpers' tiny data, 400 training graphs: 13 steps, one epoch), fp32, 2
    micro-batches per step, a checkpoint every 3 steps, evaluated at its end only; runs and MLflow
    under the cluster's shared directory."""
    from pipeline.config import JobConfig
    from preprocessing.sources import ensure_dataset

    values = tiny_job_dict(tiny_base, epochs=1, run_name=run_name, max_failures=3, precision="fp32",
                           micro_batches_per_step=2, checkpoint_every_steps=EVERY, eval_every=100,
                           checkpoints_to_keep=3, log_every_steps=10, train_subset=400)
    values["train"]["storage_path"] = str(base / "ray")
    values["mlflow"] |= {"tracking_uri": f"sqlite:///{base / 'mlflow.db'}", "registered_model": "sat-elastic"}
    values["resources"] |= {"num_workers": workers, "cpus_per_worker": 1, "resize_check_s": 5}
    ensure_dataset(JobConfig.model_validate(values).data)  # the raw layout (no Ray), shared with other tests
    path = base / f"{run_name}.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def _train(job: Path, address: str, env: dict, log: Path, **extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", "train", str(job), "--address", address],
                            env=dict(env, **extra), cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True)


def _note(run_dir: Path) -> dict:
    from pipeline.train.elastic import read_note
    from runtime.storage import resolve

    return read_note(resolve(run_dir)) or {"global_step": 0, "world_size": 0}


def _registered(run_dir: Path, steps: int) -> bool:
    """Whether Ray Train has registered a checkpoint of global step ``steps`` or later."""
    try:
        snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
        return int(snapshot["latest_checkpoint_result"]["metrics"]["global_step"]) >= steps
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _history(base: Path, run_name: str, key: str) -> tuple[list[tuple[int, float]], dict]:
    """``key``'s values over the global step in the run's one MLflow run, and the run's tags."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{base / 'mlflow.db'}")
    runs = [r for r in client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
            if r.data.tags.get("satp.run_key") == f"{base / 'ray'}/{run_name}"]
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    return sorted((m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id, key)), runs[0].data.tags


@pytest.mark.ray
@pytest.mark.slow
def test_a_run_shrinks_on_a_lost_node_and_grows_when_one_joins(cluster, tmp_path, tmp_path_factory, capsys):
    from pipeline.train import checkpoint as ckpt

    base, env, address = cluster["base"], cluster["env"], cluster["address"]
    tiny_base = tmp_path_factory.getbasetemp() / "satp-tiny"
    tiny_base.mkdir(exist_ok=True)
    node_b = cluster["add_node"]()

    # ---- the reference: 2 workers throughout
    fixed = _train(_job(base, tiny_base, "fixed", 2), address, env, tmp_path / "fixed.log")
    assert fixed.wait(timeout=900) == 0, (tmp_path / "fixed.log").read_text()[-4000:]

    # ---- the elastic run: node B lost while the checkpoint of step CUT is written, node C joins
    run_dir, marker, log = base / "ray" / "elastic", tmp_path / "paused", tmp_path / "elastic.log"
    fault = {"pause_in_checkpoint": {"rank": 1, "step": CUT, "seconds": 300}, "marker": str(marker),
             "hold": {"step": HOLD, "world_size": 1}}
    elastic = _train(_job(base, tiny_base, "elastic", [1, 2]), address, env, log, SATP_TEST_FAULT=json.dumps(fault))
    wait_until(marker.exists, "a rank paused in the checkpoint of step 6", timeout=600, proc=elastic)
    wait_until(lambda: _registered(run_dir, EVERY), "the checkpoint of step 3 registered", proc=elastic)
    note = _note(run_dir)
    assert (note["global_step"], note["world_size"]) == (CUT, 2)
    node_b.kill()
    killed_at = time.time()
    wait_until(lambda: _note(run_dir) == dict(_note(run_dir), world_size=1, global_step=HOLD),
               "1 worker at step 11", timeout=600, proc=elastic)
    cluster["add_node"]()  # node C: the next resize check grows the run
    joined_at = time.time()
    wait_until(lambda: _note(run_dir)["world_size"] == 2, "2 workers again", timeout=600, proc=elastic)
    assert elastic.wait(timeout=900) == 0, log.read_text()[-4000:]
    text = log.read_text()
    assert "registered model: models:/sat-elastic/" in text
    # every group's workers forked from the fork server the command's environment names (ray_nodes)
    assert "(forked worker process)" in text and "start-up" in text
    # a group Train sized by the lost node's CPUs waits the elastic run's timeout, not Train's 60 s
    assert "timed out after 60.0 seconds" not in text

    # what the run kept: every step once, at the worker counts that trained it
    manager = ckpt.CheckpointManager(run_dir)
    state = manager.state(manager.newest_intact())
    resizes = [e for e in state["events"] if e["kind"] == "resize"]
    assert [(e["from"], e["to"]) for e in resizes] == [(2, 1), (1, 2)], state["events"]
    # the cut checkpoint (rank 1's part never completed) was never resumed from: the one before was
    assert resizes[0]["step"] == EVERY and resizes[0]["steps_lost"] == CUT - EVERY
    assert resizes[1]["step"] == 3 * EVERY and resizes[1]["steps_lost"] == HOLD - 3 * EVERY
    problems = [manager.verify(name) for name in manager.list()]
    assert problems == [None] * len(problems), problems  # the cut one was removed with the run's end
    losses, tags = _history(base, "elastic", "train_step_loss")
    workers, _ = _history(base, "elastic", "world_size")
    steps = [s for s, _ in losses]
    assert steps == list(range(1, state["steps"] + 1)) == [s for s, _ in workers]
    counts = [int(w) for _, w in workers]
    assert [c for i, c in enumerate(counts) if i == 0 or c != counts[i - 1]] == [2, 1, 2]
    assert {"satp.resize.1", "satp.resize.2"} <= set(tags) and "2 -> 1 workers" in tags["satp.resize.1"]

    # the same global batches as the fixed run: the same loss at every step. fp32; 1 and 2 workers
    # sum the same gradients in another order, ~1e-7 relative, which AdamW carries on: seen 4e-8
    # relative here. The bound is loose (AdamW's normalised update can turn a rounding difference in a
    # near-zero gradient into a full step for that weight) and still far below what another global
    # batch makes: a tenth of the fixed run's median change from one step to the next
    reference, _ = _history(base, "fixed", "train_step_loss")
    assert [s for s, _ in reference] == steps
    deviation = max(abs(a - b) / abs(b) for (_, a), (_, b) in zip(losses, reference))
    changes = [abs(a - b) / abs(b) for (_, a), (_, b) in zip(reference[1:], reference)]
    assert deviation < statistics.median(changes) / 10, (deviation, changes)
    with capsys.disabled():  # the cost of a resize (docs/scale.md): the shrink from the node's loss on
        print(f"\nresize 2 -> 1: {resizes[0]['time'] - killed_at:.1f} s from the node's loss to the first step, "
              f"{resizes[0]['steps_lost']} step(s) lost; resize 1 -> 2: {resizes[1]['time'] - joined_at:.1f} s from "
              f"the node's start to the first step, {resizes[1]['steps_lost']} step(s) lost (the 1-worker group held "
              f"at step {HOLD}); loss deviation from the fixed run {deviation:.1e}")
