"""The trainer without Ray, and the one checkpoint manager.

* :class:`pipeline.train.trainer.Trainer` built from a tiny PATTERN job (shards written here: transform,
  Arrow encoding, manifest) and stepped in a :class:`pipeline.train.context.LocalContext` (one process,
  real DeepSpeed on a gloo group of one): every step seen by ``on_step``, a checkpoint per epoch that
  verifies. The plan decides each rerun once (:meth:`pipeline.train.plan.JobPlan.decision`), as the
  driver has it: the same job is finished, one with more epochs resumes from the last checkpoint and
  trains only the epoch left. Each trainer runs in a process of its own (DeepSpeed initialises one
  process group per process).
* :class:`pipeline.train.checkpoint.CheckpointManager` on a run folder: write, list, verify (sizes and
  sha256), the newest intact one when the newest is damaged, prune what Ray never registered.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.train.checkpoint import RANK_FILE, SNAPSHOT, STATE_FILE, CheckpointManager

ROOT = Path(__file__).resolve().parents[1]


# ============================================================================= the checkpoint manager
def _part(where: Path, epoch: int, steps: int) -> Path:
    """A rank-0 part of a checkpoint as :func:`pipeline.train.checkpoint.save` leaves it locally:
    its files, then their list with sizes and digests."""
    import hashlib

    files = {STATE_FILE: json.dumps({"epoch": epoch, "steps": steps, "world_size": 1}).encode(),
             "ds/last/mp_rank_00_model_states.pt": os.urandom(50_000), "best_model.pt": os.urandom(500)}
    for name, data in files.items():
        (where / name).parent.mkdir(parents=True, exist_ok=True)
        (where / name).write_bytes(data)
    listed = {name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()} for name, data in files.items()}
    (where / RANK_FILE.format(rank=0)).write_text(json.dumps({"files": listed}))
    return where


def _write(manager: CheckpointManager, tmp: Path, epoch: int, steps: int) -> str:
    name = manager.write(_part(tmp / f"part-{epoch}-{steps}", epoch, steps), rank=0, epoch=epoch)
    time.sleep(0.01)  # names are timestamps to the microsecond
    return name


def test_checkpoint_manager_writes_verifies_picks_the_newest_intact_and_prunes(tmp_path, capfd):
    run = tmp_path / "run"
    manager = CheckpointManager(run)
    first = _write(manager, tmp_path, 0, 4)
    middle = _write(manager, tmp_path, 1, 6)  # within epoch 1: after epoch 0's end
    last = _write(manager, tmp_path, 1, 8)
    assert manager.list() == [last, middle, first]
    assert [manager.verify(n) for n in manager.list()] == [None, None, None]
    assert manager.state(last)["steps"] == 8 and manager.progress(middle) == (1, 6)

    damaged = run / last / "ds" / "last" / "mp_rank_00_model_states.pt"
    with open(damaged, "r+b") as f:  # one bit flipped: the size stays, the digest differs
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0x01]))
    assert manager.verify(last).startswith(f"{damaged}: its content differs from what was written (sha256 mismatch")
    os.truncate(run / middle / "best_model.pt", 100)
    assert manager.verify(middle) == f"{run / middle / 'best_model.pt'}: 100 bytes where 500 were written (cut short)"
    capfd.readouterr()
    assert manager.newest_intact() == first
    assert manager.newest_intact([last]) == first  # a damaged first choice (Ray's registered one) falls back
    lines = [l for l in capfd.readouterr().err.splitlines() if l.startswith("satp: ")]
    assert len(lines) == 2, lines  # each damaged checkpoint named once, however often it is looked at
    assert lines[0].startswith(f"satp: warning: {damaged}: ") and f"checkpoint {last} (epoch 1) is damaged" in lines[0]
    assert lines[0].endswith(f"the run goes on from {first} (epoch 0)")
    told = CheckpointManager(run, damaged=manager.damaged)  # a worker told what the driver named
    assert told.newest_intact([last]) == first and capfd.readouterr().err == ""

    assert manager.prune() == []  # without Ray's record nothing is deleted
    (run / SNAPSHOT).write_text(json.dumps({"checkpoint_results": [{"checkpoint_dir_name": first}]}))
    assert manager.registered() == [first]
    assert manager.prune(keep=middle) == [last]
    assert manager.list() == [middle, first]


def test_a_part_never_completely_written_is_not_intact(tmp_path):
    manager = CheckpointManager(tmp_path / "run")
    intact = _write(manager, tmp_path, 0, 2)
    cut = _write(manager, tmp_path, 1, 4)
    (tmp_path / "run" / cut / RANK_FILE.format(rank=0)).unlink()  # killed before its list was copied
    assert manager.verify(cut) == f"{tmp_path / 'run' / cut / 'rank_0.json'}: missing (rank 0's part was never " \
                                  "completely written)"
    assert manager.newest_intact(warn=False) == intact


# ============================================================================= the trainer without Ray
def _write_pattern_shards(out: Path, graphs: dict[str, int]) -> Path:
    """A PATTERN shard directory (node classification, RWPE) in the layout of :mod:`preprocessing.shards`."""
    from preprocessing.config import TransformConfig
    from preprocessing.shard_places import sha256_file
    from preprocessing.shards import MANIFEST, SCHEMA_VERSION, column_specs, encode_shard
    from preprocessing.transforms import transform_graph

    rng = np.random.default_rng(0)
    transform = TransformConfig(rwpe_steps=3, k_hops=0)
    specs = column_specs("pattern", transform)
    out.mkdir(parents=True)
    entries, splits = [], {}
    for split, count in graphs.items():
        rows = []
        for gid in range(count):
            n = int(rng.integers(8, 20))
            edges = rng.integers(0, n, size=(2, 3 * n))
            raw = {"graph_id": gid, "num_nodes": n, "edge_index": np.concatenate([edges, edges[::-1]], axis=1),
                   "x": rng.integers(0, 3, n), "node_label": rng.integers(0, 2, n)}
            rows.append(transform_graph(raw, "pattern", transform, None))
        path = out / f"{split}-00000.arrow"
        path.write_bytes(encode_shard(rows, specs))
        entries.append({"file": path.name, "split": split, "rows": count, "bytes": path.stat().st_size,
                        "sha256": sha256_file(path)})
        splits[split] = {"graphs": count, "shards": [path.name]}
    (out / MANIFEST).write_text(json.dumps({"schema_version": SCHEMA_VERSION, "dataset": "pattern", "task": "pattern",
                                            "columns": specs, "splits": splits, "shards": entries}))
    return out


TRAIN = r'''
import json, sys
from pipeline.config import JobConfig
from pipeline.train.context import LocalContext
from pipeline.train.plan import JobPlan
from pipeline.train.trainer import Trainer

shard_dir, storage, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3])
job = JobConfig.model_validate({
    "name": "trainer-local",
    "data": {"name": "pattern", "root": storage + "/data", "source": "sbm"},
    "transform": {"rwpe_steps": 3, "k_hops": 0},
    "model": {"hidden_dim": 16, "num_layers": 2, "num_heads": 2, "k_hops": 1, "gnn_type": "gcn",
              "use_edge_attr": False, "pe": "rwpe", "pe_dim": 3, "norm": "batch"},
    "train": {"task": "pattern", "epochs": epochs, "node_budget": 120, "max_graphs_per_batch": 8,
              "precision": "fp32", "lr": 1e-3, "storage_path": storage, "log_every_steps": 1000},
    "resources": {"num_workers": 1, "use_gpu": False, "cpus_per_worker": 1},
    "mlflow": {"enabled": False},
})
# as the driver does, without Ray: the plan decided once, then the trainer on its setup
plan = JobPlan.resolve(job).examine().with_shards(shard_dir)
decision = plan.decision()
out = {"action": decision.action}
if decision.action != "finished":
    plan = plan.with_setup(provenance=decision.provenance,
                           resume_from=decision.previous.name if decision.action == "resume" else None)
    context = LocalContext(plan.checkpoints.named)
    steps = []
    trainer = Trainer(plan.setup, context, on_step=lambda t, global_step: steps.append(global_step))
    out["start_epoch"] = trainer.position.epoch
    trainer.fit()
    out.update(steps=steps, steps_per_epoch=trainer.batches.steps_per_epoch, run_dir=plan.checkpoints.named,
               reports=[[m["epoch"], m["global_step"], m.get("val_acc"), c] for m, c in context.reports])
print("RESULT " + json.dumps(out))
'''


def _train(shards: Path, storage: Path, epochs: int) -> dict:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", OUTDATED_IGNORE="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # the trainer's LocalContext sets them (a group of one on a free port)
    proc = subprocess.run([sys.executable, "-c", TRAIN, str(shards), str(storage), str(epochs)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
def test_a_trainer_is_built_and_stepped_without_ray_and_the_plan_decides_its_reruns(tmp_path):
    shards = _write_pattern_shards(tmp_path / "shards", {"train": 24, "valid": 8, "test": 8})
    storage = tmp_path / "ray"
    first = _train(shards, storage, epochs=2)
    per_epoch = first["steps_per_epoch"]
    assert first["action"] == "fresh" and per_epoch >= 2 and first["start_epoch"] == 0
    assert first["steps"] == list(range(1, 2 * per_epoch + 1))  # on_step after every optimizer step
    assert [r[:2] for r in first["reports"]] == [[0, per_epoch], [1, 2 * per_epoch]]
    assert all(r[2] is not None for r in first["reports"])  # evaluated every epoch
    manager = CheckpointManager(first["run_dir"])
    names = [r[3] for r in first["reports"]]
    assert sorted(manager.list()) == sorted(names) and all(manager.verify(n) is None for n in names)
    assert manager.state(names[-1])["epoch"] == 1

    assert _train(shards, storage, epochs=2) == {"action": "finished"}  # nothing left to train
    again = _train(shards, storage, epochs=3)  # more epochs: the run resumes from its last checkpoint
    assert again["action"] == "resume" and again["start_epoch"] == 2
    assert again["steps"] == list(range(2 * per_epoch + 1, 3 * per_epoch + 1))
    assert [r[:2] for r in again["reports"]] == [[2, 3 * per_epoch]]
    assert [h["epoch"] for h in manager.state(again["reports"][-1][3])["history"]] == [0, 1, 2]


def test_the_plan_is_read_only_and_decides_after_it_looked_at_the_run(tmp_path):
    import dataclasses

    from pipeline.config import JobConfig
    from pipeline.train.plan import JobPlan

    plan = JobPlan.resolve(JobConfig.model_validate({
        "name": "read-only", "data": {"name": "pattern", "root": str(tmp_path / "data"), "source": "sbm"},
        "model": {}, "train": {"task": "pattern", "storage_path": str(tmp_path / "ray")}, "mlflow": {"enabled": False}}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.restart = True
    with pytest.raises(RuntimeError, match="before JobPlan.examine"):
        plan.decision()
    examined = plan.examine()
    assert examined.examined and not plan.examined
    assert examined.previous is None and examined.decision() is None  # a new run: decided with its data
