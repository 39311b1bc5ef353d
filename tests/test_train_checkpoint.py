"""Checkpoint round trip of the DeepSpeed engine + loop state, in fresh processes.

DeepSpeed cannot be initialised twice in one process, so the save and
the restore each run in a subprocess: the first trains 3 steps, checkpoints,
then takes a 4th step; the second restores the checkpoint and must take the
same 4th step (same loss, same lr, same weights).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.helpers import run_one_rank

SCRIPT = r'''
import json, os, sys
import torch
from torch_geometric.data import Batch
from sat import SAT, SATConfig, SATData
from pipeline.train import checkpoint as ckpt
from pipeline.train.engine import build_engine, clips_outside_deepspeed
from pipeline.tasks import Code2Task
from pipeline.train.step import TrainStep
from pipeline.config.train import TrainConfig

mode, directory, precision = sys.argv[1], sys.argv[2], sys.argv[3]
torch.manual_seed(0)
vocab = [f"t{i}" for i in range(20)] + ["__UNK__", "__EOS__"]
task = Code2Task(vocab)

def graph(n, g):
    gen = torch.Generator().manual_seed(g)
    parent = torch.randint(0, 1, (n - 1,))
    ei = torch.stack([torch.tensor([torch.randint(0, i, (1,), generator=gen).item() for i in range(1, n)]), torch.arange(1, n)])
    ei = torch.cat([ei, ei.flip(0)], 1)
    ea = torch.zeros(ei.size(1), 2, dtype=torch.long); ea[n - 1:, 1] = 1
    x = torch.stack([torch.randint(0, 98, (n,), generator=gen), torch.randint(0, 100, (n,), generator=gen)], 1)
    y = torch.randint(0, 22, (1, 5), generator=gen)
    return SATData(x=x, edge_index=ei, edge_attr=ea, node_depth=torch.randint(0, 20, (n,), generator=gen), y=y, num_nodes=n)

batches = [Batch.from_data_list([graph(8 + 3 * j, 10 * s + j) for j in range(4)]) for s in range(4)]
cfg = task.configure(SATConfig(hidden_dim=16, num_layers=1, num_heads=2, dropout=0.0), batches[0].get_example(0))
model = SAT(cfg)
train = TrainConfig(epochs=2, warmup_epochs=0.5, lr=1e-2, grad_clip=1.0)
engine = build_engine(model, train, precision, steps_per_epoch=4, world_size=1)

train_step = TrainStep(engine, task, train.grad_clip, clips_outside_deepspeed(train, precision))

def step(b):
    engine.train()
    return float(train_step(b)[1])

out = {}
if mode == "save":
    out["losses"] = [step(b) for b in batches[:3]]
    state = {"epoch": 0, "sampler": {"seed": 0, "epoch": 0}, "best": {"epoch": 0, "val": 0.5, "test": 0.4}, "history": [{"epoch": 0}]}
    best = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    ckpt.save(directory, engine, state, best, rank=0)
else:
    state = ckpt.restore(directory, engine)
    out["state"] = state
    out["best_keys"] = len(ckpt.load_best_weights(directory))
out["lr"] = engine.optimizer.param_groups[0]["lr"]
out["steps"] = engine.global_steps
out["next_loss"] = step(batches[3])
out["weights"] = float(sum(p.double().sum() for p in engine.module.parameters()))
out["deepspeed_clipping"] = engine.gradient_clipping()
print("RESULT " + json.dumps(out))
'''


def _run(mode: str, directory: Path, precision: str) -> dict:
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", DS_ACCELERATOR="cpu",
               OMP_NUM_THREADS="1")
    proc = run_one_rank([sys.executable, "-c", SCRIPT, mode, str(directory), precision], env, 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
def test_checkpoint_round_trip(tmp_path):
    from pipeline.train.engine import resolve_precision

    precision = resolve_precision("auto", use_gpu=False)
    saved = _run("save", tmp_path / "ckpt", precision)
    assert (tmp_path / "ckpt" / "state.json").is_file() and (tmp_path / "ckpt" / "best_model.pt").is_file()
    restored = _run("load", tmp_path / "ckpt", precision)
    assert restored["state"]["best"] == {"epoch": 0, "val": 0.5, "test": 0.4}
    assert restored["state"]["sampler"] == {"seed": 0, "epoch": 0}
    assert restored["best_keys"] > 0
    assert restored["steps"] == saved["steps"] == 3
    assert restored["lr"] == pytest.approx(saved["lr"])
    assert restored["next_loss"] == pytest.approx(saved["next_loss"], rel=1e-4)
    assert restored["weights"] == pytest.approx(saved["weights"], rel=1e-5)
    # ZeRO 0: the step clips (one foreach norm); DeepSpeed, whose default clips at 1.0, must not again
    assert saved["deepspeed_clipping"] == 0.0


def test_incomplete_checkpoint_is_rejected(tmp_path):
    from pipeline.train import checkpoint as ckpt

    (tmp_path / "ds").mkdir()
    with pytest.raises(ValueError, match="incomplete checkpoint"):
        ckpt.load_state(tmp_path)


def test_registered_epoch_logger_logs_each_reported_epoch_once(tmp_path):
    """Ray Train's controller calls this after registering a report: rank 0's metrics go to MLflow at
    step = epoch, the curves from the checkpoint's history; a report without an epoch (Tune's
    bookkeeping) logs nothing; a store that fails does not stop training."""
    import mlflow
    from mlflow.tracking import MlflowClient
    from ray.train import Checkpoint

    from pipeline.train.epoch_logger import RegisteredEpochLogger

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("epochs", artifact_location=str(tmp_path / "art"))).info.run_id
    callback = RegisteredEpochLogger(uri, run_id, "acc")
    history = []
    for epoch, loss in enumerate([0.9, 0.7]):
        entry = {"epoch": epoch, "train_loss": loss, "val_acc": 0.5 + epoch / 10}
        history.append(entry)
        directory = tmp_path / f"ckpt{epoch}"
        directory.mkdir()
        (directory / "state.json").write_text(json.dumps({"epoch": epoch, "history": history}))
        rank1 = {"epoch": epoch}  # other ranks report fewer keys; rank 0's are logged
        callback.after_report(None, [entry, rank1], Checkpoint.from_directory(str(directory)))
    callback.after_report(None, [{"train_loss": 5.0}], None)
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train_loss")) == [(0, 0.9), (1, 0.7)]
    assert sorted(m.step for m in client.get_metric_history(run_id, "val_acc")) == [0, 1]
    assert [a.path for a in client.list_artifacts(run_id, "plots")] == ["plots/training_curves.png"]

    broken = RegisteredEpochLogger("sqlite:///" + str(tmp_path / "missing-dir" / "x.db"), run_id, "acc")
    broken.after_report(None, [{"epoch": 2, "train_loss": 0.5}], None)  # a warning, no exception


def test_a_killed_workers_staging_folder_is_removed_by_the_next_checkpoint(tmp_path, monkeypatch):
    """A worker killed while it wrote its part of a checkpoint leaves its local folder; the next
    checkpoint on the machine removes the folders of processes that have ended, and only those."""
    import hashlib
    import subprocess
    import tempfile

    from pipeline.train.lease import process_started, this_machine
    from pipeline.train.reporting import STAGING_PREFIX, staging_folder

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen(["sleep", "60"])
    gone_started = process_started(gone.pid)
    gone.kill()
    gone.wait()
    me, machine = os.getpid(), hashlib.sha1(this_machine().encode()).hexdigest()[:10]
    mine = f"{STAGING_PREFIX}{machine}-{me}-{process_started(me)}-"
    folders = {"killed": tmp_path / f"{STAGING_PREFIX}{machine}-{gone.pid}-{gone_started}-abc",
               "running": tmp_path / f"{mine}def",
               "recycled pid": tmp_path / f"{STAGING_PREFIX}{machine}-{me}-{process_started(me) - 1}-ghi",  # an earlier one
               "another container's": tmp_path / f"{STAGING_PREFIX}0123456789-{gone.pid}-{gone_started}-jkl",
               "unnamed": tmp_path / f"{STAGING_PREFIX}mno"}  # of satp before the names: whose, unknown
    for folder in folders.values():
        folder.mkdir()
        (folder / "model_states.pt").write_bytes(b"x" * 1024)
    with staging_folder() as directory:
        assert Path(directory).parent == tmp_path and Path(directory).name.startswith(mine)
        assert {what for what, folder in folders.items() if folder.exists()} == \
            {"running", "another container's", "unnamed"}
    assert not Path(directory).exists()
