"""An ASHA sweep end to end on the session's local Ray (2 CPUs), MLflow on SQLite, then the registry.

One sweep (module fixture) on a tiny offline code2 dataset (a few standard-library modules):
4 trials of 1 Train worker (0.5 CPU) each, at most 3 at once, 2 epochs. The grid's last value
(lr 1e-5) starts only after the first three trials have passed ASHA's rung at epoch 1 with far
lower losses, so ASHA must stop it there: the early stop is deterministic, not a race.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import parent_and_children

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
LRS = [1e-2, 3e-3, 1e-3, 1e-5]


def sweep_job(tmp: Path, src: Path, **tune_overrides):
    from pipeline.config import JobConfig

    tune = {
        "name": "t-sweep",
        "storage_path": str(tmp / "tune"),
        "num_samples": 1,
        "metric": "train_loss",
        "mode": "min",
        "max_concurrent_trials": 3,
        "asha": {"grace_period": 1, "reduction_factor": 2, "max_epochs": 2},
        "space": {"train.lr": {"grid": LRS}},
    }
    tune.update(tune_overrides)
    return JobConfig.model_validate({
        "name": "t",
        "data": {"name": "ogbg-code2", "root": str(tmp / "data"), "source": "pycode", "source_dirs": [str(src)]},
        "transform": {"rwpe_steps": 0, "k_hops": 0, "vocab_size": 300},
        "shards": {"root": str(tmp / "shards"), "graphs_per_shard": 512},
        "model": {"hidden_dim": 16, "num_layers": 1, "num_heads": 2, "dropout": 0.0, "k_hops": 1, "gnn_type": "gcn"},
        "train": {"task": "code2", "epochs": 2, "warmup_epochs": 0, "scheduler": "constant", "node_budget": 4096,
                  "log_every_steps": 1000, "max_failures": 0},
        "resources": {"num_workers": 1, "cpus_per_worker": 0.5},
        "mlflow": {"tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}", "experiment": "t-sweep",
                   "registered_model": "sat-t", "log_system_metrics": False},
        "tune": tune,
    })


@pytest.fixture(scope="module")
def sweep(ray_cluster, tmp_path_factory):
    from tests.helpers import small_python_source
    from pipeline.sweep.tune import run_sweep

    tmp = tmp_path_factory.mktemp("sweep")
    src = small_python_source(tmp / "src")
    job = sweep_job(tmp, src)
    outcome = run_sweep(job, verbose=0)
    (shards,) = [p.parent for p in (tmp / "shards").glob("*/manifest.json")]  # the one preprocessing of the space
    return {"tmp": tmp, "src": src, "job": job, "outcome": outcome, "uri": job.mlflow.tracking_uri, "shards": shards}


def test_asha_stops_a_trial_early(sweep):
    out = sweep["outcome"]
    assert len(out.trials) == 4 and not out.interrupted
    by_lr = {t.config["train.lr"]: t for t in out.trials}
    assert sorted(by_lr) == sorted(LRS)
    assert all(t.status != "error" for t in out.trials), [(t.trial_id, t.status) for t in out.trials]
    stopped = out.early_stopped
    assert stopped, [(t.trial_id, t.status, t.epochs) for t in out.trials]
    assert by_lr[1e-5].status == "early_stopped" and by_lr[1e-5].epochs == 1
    assert any(t.status == "finished" and t.epochs == 2 for t in out.trials)
    # the best trial is the best by the sweep's metric
    finished = [t for t in out.trials if t.best is not None]
    assert out.best.best == min(t.best for t in finished)


def test_stopped_trials_leave_no_reserved_cpus(sweep):
    """ASHA kills stopped trials' Train controllers; their workers' placement groups are released."""
    import time

    import ray

    deadline = time.time() + 60  # a liveness bound (the release is asynchronous), left at once when met
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"] and time.time() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"]


def test_mlflow_holds_parent_and_child_runs(sweep):
    out = sweep["outcome"]
    client, _, children = parent_and_children(sweep["uri"], "t-sweep", "sweep", out.parent_run_id)
    assert len(children) == 4
    for child in children:
        tid = child.data.tags["satp.trial_id"]
        trial = next(t for t in out.trials if t.trial_id == tid)
        assert float(child.data.params["train.lr"]) == trial.config["train.lr"]
        history = client.get_metric_history(child.info.run_id, "train_loss")
        assert sorted(m.step for m in history) == list(range(trial.epochs))
        assert len(client.get_metric_history(child.info.run_id, "val_f1")) == trial.epochs
        assert child.info.status == ("KILLED" if trial.status == "early_stopped" else "FINISHED")
    artifacts = [a.path for a in client.list_artifacts(out.parent_run_id, "plots")]
    assert "plots/sweep_val_curves.png" in artifacts
    # artifacts live beside the SQLite file, not in the current directory
    assert (sweep["tmp"] / "mlartifacts").is_dir()


def test_champion_is_the_best_trials_version(sweep):
    from mlflow.tracking import MlflowClient

    out = sweep["outcome"]
    client = MlflowClient(sweep["uri"])
    champion = client.get_model_version_by_alias("sat-t", "champion")
    assert int(champion.version) == out.registered["version"]
    assert champion.run_id == out.best.run_id
    tags = champion.tags
    assert tags["task"] == "code2" and tags["data_manifest_hash"] and tags["git_commit"]
    assert "metric.best_val_f1" in tags


def _checkpoint_model(trial):
    from pipeline.train import checkpoint as ckpt
    from pipeline.train.engine import build_model
    from sat.config import SATConfig

    state = ckpt.load_state(trial.checkpoint_path)
    model = build_model(SATConfig.from_dict(state["model_config"]))
    model.load_state_dict(ckpt.load_best_weights(trial.checkpoint_path))
    return model.eval()


def _chunks(graphs, size=None):
    """Batches as `pipeline.registry.predict` makes them: the exact comparisons below hold for the same
    batches only (another batch composition changes the dense-attention blocks, hence the bits)."""
    from torch_geometric.data import Batch

    from pipeline.registry.predict import BATCH_GRAPHS

    size = size or BATCH_GRAPHS
    return [Batch.from_data_list(graphs[i : i + size]) for i in range(0, len(graphs), size)]


def test_loaded_model_equals_model_at_end_of_training(sweep):
    from pipeline.registry.predict import load
    from preprocessing.reader import ShardDataset

    out = sweep["outcome"]
    trained = _checkpoint_model(out.best)
    loaded = load("models:/sat-t@champion", tracking_uri=sweep["uri"])
    test = ShardDataset(sweep["shards"], "test")
    graphs = [test[i] for i in range(len(test))]
    with torch.no_grad():
        for batch in _chunks(graphs):
            assert torch.equal(loaded.model(batch), trained(batch))
        expected = torch.cat([trained(b) for b in _chunks(graphs)])
    assert torch.equal(loaded.outputs(graphs), expected)
    state = {k: v for k, v in trained.state_dict().items()}
    for key, value in loaded.model.state_dict().items():
        assert torch.equal(value, state[key]), key
    # a shard directory as predict's input: every graph of the split, in order
    pairs = loaded.predict_file(sweep["shards"], split="test")
    with torch.no_grad():
        expected_tokens = [p for b in _chunks(graphs) for p in loaded.task.predict(trained(b))]
    assert [p for _, p in pairs] == expected_tokens and pairs[0][0].startswith("test[0] graph ")


def test_source_graphs_match_the_training_shards(sweep):
    """Graphs that predict builds from a source file are the training data's graphs of that file."""
    import csv
    import gzip

    from pipeline.registry.predict import load
    from preprocessing.reader import ShardDataset

    out = sweep["outcome"]
    model = load("models:/sat-t@champion", tracking_uri=sweep["uri"])
    folder = sweep["tmp"] / "data" / "ogbg_code2"
    with gzip.open(folder / "mapping" / "graphidx2source.csv.gz", "rt") as fh:
        ids = [int(r[0]) for r in list(csv.reader(fh))[1:] if r[2] == "shlex.py"]
    shard_dir = sweep["shards"]
    by_id = {}
    for split in ("train", "valid", "test"):
        ds = ShardDataset(shard_dir, split)
        for i, gid in enumerate(ds.graph_ids):
            if int(gid) in ids:
                by_id[int(gid)] = ds[i]
    assert len(by_id) == len(ids) > 5
    items = [it for it in model.source_graphs((sweep["src"] / "shlex.py").read_text(), "shlex.py") if it[2]]
    assert len(items) == len(ids)
    for (name, line, actual, data), gid in zip(items, ids):
        ref = by_id[gid]
        assert actual == list(ref.y_tokens)
        for key in ("x", "edge_index", "edge_attr", "node_depth", "y", "degree"):
            assert torch.equal(getattr(data, key), getattr(ref, key)), (name, key)


def test_predict_cli_in_a_fresh_process_reproduces_training(sweep):
    out = sweep["outcome"]
    trained = _checkpoint_model(out.best)
    from pipeline.registry.predict import load

    model = load("models:/sat-t@champion", tracking_uri=sweep["uri"])
    src_file = sweep["src"] / "textwrap.py"
    items = model.source_graphs(src_file.read_text(), str(src_file))
    with torch.no_grad():
        expected = [p for b in _chunks([d for *_, d in items]) for p in model.task.predict(trained(b))]
    # the same number of intra-op threads as here: exact equality of argmax decodings is claimed
    # for the same computation, and a parallel reduction split differently rounds differently
    env = dict(os.environ, OUTDATED_IGNORE="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(torch.get_num_threads()))
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "predict", f"models:/sat-t/{out.registered['version']}", str(src_file),
         "--tracking-uri", sweep["uri"], "--json"],
        capture_output=True, text=True, timeout=300, env=env, cwd=str(sweep["tmp"]),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["name"] for r in rows] == [name for name, *_ in items]
    assert [r["predicted"] for r in rows] == expected
    assert rows[0]["line"] > 0 and isinstance(rows[0]["actual"], list)


def test_rerun_resumes_instead_of_starting_over(sweep):
    from mlflow.tracking import MlflowClient

    from pipeline.sweep.tune import run_sweep

    again = run_sweep(sweep["job"], verbose=0)
    assert again.resumed
    assert sorted(t.trial_id for t in again.trials) == sorted(t.trial_id for t in sweep["outcome"].trials)
    assert again.registered["version"] == sweep["outcome"].registered["version"]  # not registered twice
    client = MlflowClient(sweep["uri"])
    exp = client.get_experiment_by_name("t-sweep")
    assert len(client.search_runs([exp.experiment_id])) == 5  # the same parent + 4 children
    assert len(client.search_model_versions("name='sat-t'")) == 1


def test_models_cli_lists_versions(sweep, capsys):
    from pipeline.cli import main

    assert main(["models", "--tracking-uri", sweep["uri"]]) == 0
    text = capsys.readouterr().out
    assert "sat-t" in text and "@champion" in text and "best_val_f1" in text and "data " in text
    assert main(["models", "--tracking-uri", sweep["uri"], "--json"]) == 0
    models = json.loads(capsys.readouterr().out)
    version = models[0]["versions"][0]
    assert version["aliases"] == ["champion"] and version["git_commit"] and version["data_manifest_hash"]


def test_champion_moves_only_for_a_better_version_in_the_registry(sweep):
    """The sweep's promotion rule on the real registry: a worse version leaves the alias, a better
    one takes it and the replaced version is tagged with the reason."""
    from mlflow.tracking import MlflowClient

    from pipeline.registry.versions import promote

    client = MlflowClient(sweep["uri"])
    champion = client.get_model_version_by_alias("sat-t", "champion")
    value = float(champion.tags["metric.best_val_f1"])

    def new_version(v):
        return client.create_model_version("sat-t", champion.source, run_id=champion.run_id,
                                           tags={"metric.best_val_f1": str(v)})

    worse = new_version(value - 0.01)
    assert not promote(client, "sat-t", int(worse.version), value - 0.01, "best_val_f1", "max", "champion", "s2")["champion"]
    assert client.get_model_version_by_alias("sat-t", "champion").version == champion.version
    assert "does not beat" in client.get_model_version("sat-t", worse.version).tags["satp.champion_decision"]
    better = new_version(value + 0.01)
    assert promote(client, "sat-t", int(better.version), value + 0.01, "best_val_f1", "max", "champion", "s3")["champion"]
    assert client.get_model_version_by_alias("sat-t", "champion").version == better.version
    old = client.get_model_version("sat-t", champion.version).tags
    assert old["satp.replaced_by"] == str(better.version) and "s3" in old["satp.replaced_reason"]
