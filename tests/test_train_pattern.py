"""PATTERN node classification end to end on the shared local Ray cluster: a tiny regenerated PATTERN
(420 graphs), k-subtree SAT trained by one Ray Train + DeepSpeed worker, the class-averaged accuracy
beating the majority class, the model registered in MLflow (SQLite), then ``satp predict`` on a JSON
graph file giving the same outputs as the shards' graphs."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import pattern_job_dict

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def sbm_root(tmp_path_factory):
    """A small PATTERN (300 / 60 / 60 graphs) by the benchmark's recipe."""
    from preprocessing.sbm import build_sbm

    root = tmp_path_factory.mktemp("sbm")
    build_sbm(root, "pattern", graphs=420, seed=0)
    return root


def test_tiny_pattern_run_beats_the_majority_class_and_predicts(ray_cluster, sbm_root, tmp_path, capsys):
    from pipeline.cli import main
    from pipeline.config import JobConfig
    from pipeline.train.loader import open_split
    from pipeline.registry.predict import load
    from pipeline.train.driver import train_job

    job = JobConfig.model_validate(pattern_job_dict(sbm_root, tmp_path, precise_bn_batches=3))
    outcome = train_job(job)
    assert (outcome.task, outcome.metric) == ("pattern", "acc")
    assert outcome.constant == pytest.approx(0.5)  # the majority class: class-averaged accuracy 1/2
    assert [h["epoch"] for h in outcome.history] == [0, 1, 2]
    assert all(0.0 <= h[f"{split}_acc"] <= 1.0 for h in outcome.history for split in ("train", "val", "test"))
    # train.precise_bn_batches: the validation accuracy under the moving averages is kept beside
    assert all(0.0 <= h["val_acc_running_bn"] <= 1.0 for h in outcome.history)
    # and how far the moving averages were from the recomputed statistics
    assert all(h["bn_var_ratio"] > 0 and h["bn_worst_layer_var_ratio"] > 0 and h["bn_mean_shift"] >= 0
               for h in outcome.history), outcome.history
    # throughput counts graphs (the loss is a mean over nodes): an epoch is the 300 training graphs
    assert all(abs(h["graphs_per_s"] * h["epoch_seconds"] - 300) < 0.5 for h in outcome.history), outcome.history
    assert outcome.best["test"] > outcome.constant + 0.05, outcome.history

    uri = outcome.registered["registered_uri"]
    tracking = job.mlflow.tracking_uri
    predictor = load(uri, tracking_uri=tracking)
    assert predictor.task_name == "pattern" and predictor.task.node_level
    _assert_statistics_recomputed(job, predictor.model, outcome.best["epoch"], tmp_path)

    # a JSON graph file of two test graphs (each undirected edge once) -> one class per node, and the
    # same logits as the shards' copies of those graphs (the same featurisation: RWPE, degrees)
    test = open_split(_shard_dir(tmp_path), "test")
    graphs = [test[0], test[1]]
    rows = []
    for g in graphs:
        ei = g.edge_index[:, g.edge_index[0] < g.edge_index[1]]
        rows.append({"num_nodes": int(g.num_nodes), "edge_index": ei.tolist(), "x": g.x.view(-1).tolist()})
    path = tmp_path / "graphs.json"
    path.write_text(json.dumps(rows))
    from_json, labels = predictor.graphs_from_file(path)
    assert labels == ["graph 0", "graph 1"]
    assert torch.allclose(predictor.outputs(from_json), predictor.outputs(graphs), atol=1e-4)
    predictions = predictor.predict_file(path)
    assert [len(p) for _, p in predictions] == [int(g.num_nodes) for g in graphs]
    assert all(c in (0, 1) for _, p in predictions for c in p)

    assert main(["predict", uri, str(path), "--tracking-uri", tracking]) == 0
    out = capsys.readouterr().out
    assert "(pattern)" in out and "graph 1: node classes " in out

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{**rows[0], "x": [5] * rows[0]["num_nodes"]}]))
    assert main(["predict", uri, str(bad), "--tracking-uri", tracking]) == 2
    assert f"{bad}: graph 0: x holds 5, outside [0, 3)" in capsys.readouterr().err


def _assert_statistics_recomputed(job, model, epoch: int, base: Path) -> None:
    """The registered weights (the best epoch's) carry BatchNorm statistics recomputed over that
    epoch's statistics batches (train.precise_bn_batches), not training's moving averages."""
    import copy

    from pipeline.train.loader import BatchCollator, make_loader, open_split
    from pipeline.train.precise_bn import batchnorm_layers, recompute_batchnorm_stats
    from pipeline.train.precise_bn import statistics_batches

    train_ds = open_split(_shard_dir(base), "train")
    batches = statistics_batches(job, train_ds)
    batches.set_epoch(epoch)
    loader = make_loader(train_ds, batches, BatchCollator(model.config), 0, False)
    again = copy.deepcopy(model)
    shift = recompute_batchnorm_stats(again, loader, lambda b: again(b, validate=False))
    # the same batches under the same weights: the statistics did not move
    assert shift.var_ratio == pytest.approx(1.0, abs=1e-3)
    assert shift.mean_shift == pytest.approx(0.0, abs=1e-3)
    layers = list(zip(batchnorm_layers(model), batchnorm_layers(again)))
    assert layers
    for registered, recomputed in layers:
        assert torch.allclose(registered.running_mean, recomputed.running_mean, rtol=1e-4, atol=1e-5)
        assert torch.allclose(registered.running_var, recomputed.running_var, rtol=1e-4, atol=1e-5)


def _shard_dir(base: Path) -> Path:
    (found,) = [p for p in (base / "shards").iterdir() if p.name.startswith("pattern-")]
    return found


def test_a_pna_job_gets_the_training_graphs_in_degree_histogram(ray_cluster, sbm_root, tmp_path):
    """gnn_type: pna without a histogram: the driver's plan computes it from the train shards (the SAT
    authors' PATTERN layer `pna3`: mean/sum/max, identity, 1 tower, undivided input), the worker's
    model is built from it, and it runs on a batch of the shards."""
    from preprocessing import preprocess
    from preprocessing.reader import ShardDataset
    from torch_geometric.nn import PNAConv

    from pipeline.config import JobConfig
    from pipeline.train.loader import BatchCollator
    from pipeline.train.plan import worker_setup as plan
    from pipeline.train.engine import build_model
    from sat.config import SATConfig

    values = pattern_job_dict(sbm_root, tmp_path)
    values["model"] |= {"gnn_type": "pna", "pna_aggregators": ["mean", "sum", "max"], "pna_scalers": ["identity"],
                        "pna_towers": 1, "pna_divide_input": False}
    job = JobConfig.model_validate(values)
    assert job.model.pna_degree_histogram is None  # a job may leave it out
    shard_dir = preprocess(job.data, job.transform, job.shards, progress=False)
    train = ShardDataset(shard_dir, "train")
    in_degrees = np.concatenate([np.bincount(train[i].edge_index[1].numpy(), minlength=train[i].num_nodes)
                                 for i in range(len(train))])
    expected = np.bincount(in_degrees).tolist()

    setup = plan(job, shard_dir)
    assert setup.model_config["pna_degree_histogram"] == train.in_degree_histogram() == expected
    config = SATConfig.from_dict(setup.model_config)
    model = build_model(config)
    convs = [m for m in model.modules() if isinstance(m, PNAConv)]
    assert len(convs) == job.model.num_layers * job.model.k_hops
    assert all(c.towers == 1 and not c.divide_input and c.aggr_module.scaler == ["identity"] for c in convs)
    batch = BatchCollator(config)([train[i] for i in range(4)])
    out = model(batch)
    assert out.shape == (batch.num_nodes, 2) and torch.isfinite(out).all()


def test_static_step_pads_to_recorded_capacities_and_reports_its_startup(ray_cluster, sbm_root, tmp_path):
    """``train.step: static``: the worker chooses the batch capacities from the shards, pads every batch
    that fits (BatchNorm's statistics recomputed over padded batches too), runs the rest eagerly and
    counts them, records the capacities and the step in MLflow, and reports where its start-up went."""
    from mlflow.tracking import MlflowClient

    from pipeline.config import JobConfig
    from pipeline.train.driver import train_job
    from pipeline.train.startup import PHASES
    from sat.padding import Capacity

    job = JobConfig.model_validate(pattern_job_dict(sbm_root, tmp_path, epochs=2, step="static",
                                                    capacity_sigmas=1.0, precise_bn_batches=2))
    outcome = train_job(job)
    first, second = outcome.history
    # graphs/s still counts the 300 training graphs, not padding
    assert abs(first["graphs_per_s"] * first["epoch_seconds"] - 300) < 0.5
    assert first["overflow_batches"] >= 1  # mean + 1 sd: some batches over the capacity, run eagerly
    assert first["overflow_batches"] < job.train.epochs * 300 / 16 and "eval_overflow_batches" in first
    assert outcome.best["test"] > outcome.constant, outcome.history
    startup = {k: v for k, v in first.items() if k.startswith("startup_")}
    assert {f"startup_{phase}_s" for _event, phase in PHASES} <= startup.keys(), startup
    phases = {k: v for k, v in startup.items() if k.endswith("_s") and k != "startup_to_first_step_s"}
    assert startup["startup_to_first_step_s"] == pytest.approx(sum(phases.values()), rel=1e-6)
    assert startup["startup_warm_worker"] in (0.0, 1.0)  # a flag, not a phase
    assert not any(k.startswith("startup_") for k in second)  # once per run segment
    run = MlflowClient(job.mlflow.tracking_uri).get_run(outcome.mlflow_run_id)
    assert run.data.tags["satp.step"] == "static"
    train_capacity = Capacity.from_dict(json.loads(run.data.tags["satp.capacity.train"]))
    assert train_capacity.graphs <= 16 and train_capacity.nodes > train_capacity.graph_nodes
    assert "satp.capacity.eval" in run.data.tags
    assert run.data.metrics["startup_to_first_step_s"] == pytest.approx(startup["startup_to_first_step_s"])
