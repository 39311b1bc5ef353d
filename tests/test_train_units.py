"""Unit tests of the training pipeline's pieces (no Ray, no DeepSpeed): batching, tasks, schedule."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from benchmarks.cpu.training import padding_stats
from pipeline.train.batching import NodeBudgetSampler, pack, subset_indices
from pipeline.train.engine import clips_outside_deepspeed, deepspeed_config, resolve_precision, warmup_cosine
from pipeline.tasks import Code2Task, PPATask, best_constant_sequence, make_task, task_name_for
from pipeline.config.train import TrainConfig


def sizes(n=3000, seed=0):
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(125) - 0.28, 0.75, n), 10, 1000).astype(int)


def test_pack_respects_budget_and_keeps_large_graphs():
    s = np.array([5, 5, 5, 50, 300, 7])
    order = np.argsort(s, kind="stable")
    batches = pack(order, s, node_budget=100)
    assert sorted(np.concatenate(batches).tolist()) == list(range(6))
    for b in batches:
        assert len(b) == 1 or len(b) * s[b].max() <= 100
    assert any(len(b) == 1 and s[b[0]] == 300 for b in batches)  # too large: alone, not dropped


def test_train_sampler_deals_every_batch_and_is_deterministic():
    s = sizes()
    ranks = [NodeBudgetSampler(s, 4000, rank=r, world_size=2, seed=3) for r in range(2)]
    for epoch in range(3):
        per_rank = [r.epoch_batches(epoch) for r in ranks]
        cut = ranks[0].global_batches(epoch)
        assert [b.tolist() for b in per_rank[0]] == [b.tolist() for b in cut[0::2]]
        assert [b.tolist() for b in per_rank[1]] == [b.tolist() for b in cut[1::2]]
        again = NodeBudgetSampler(s, 4000, rank=0, world_size=2, seed=3).epoch_batches(epoch)
        assert all(np.array_equal(a, b) for a, b in zip(again, per_rank[0]))
    first = np.concatenate(ranks[0].epoch_batches(0))
    second = np.concatenate(ranks[0].epoch_batches(1))
    assert not np.array_equal(first[:50], second[:50])  # reshuffled per epoch
    stats = padding_stats(ranks[0].epoch_batches(0) + ranks[1].epoch_batches(0), s)
    assert stats["attention_padding"] < 0.15


def test_eval_sampler_covers_every_graph_once():
    s = sizes(1001)
    s[17] = 5000  # larger than the budget
    seen = np.concatenate([b for r in range(3) for b in NodeBudgetSampler(s, 4000, rank=r, world_size=3, shuffle=False).epoch_batches()])
    assert sorted(seen.tolist()) == list(range(1001))


def test_sampler_epochs_are_a_function_of_seed_and_epoch_and_subset():
    s = sizes(500)
    a = NodeBudgetSampler(s, 2000, seed=1)
    a.set_epoch(4)
    assert all(np.array_equal(x, y) for x, y in zip(a.epoch_batches(), NodeBudgetSampler(s, 2000, seed=1).epoch_batches(4)))
    idx = subset_indices(500, 100, seed=0)
    assert len(idx) == 100 and len(set(idx.tolist())) == 100
    assert subset_indices(500, None, 0) is None
    sub = NodeBudgetSampler(s, 2000, shuffle=False, indices=idx)
    assert sorted(np.concatenate(sub.epoch_batches()).tolist()) == idx.tolist()


def test_code2_task_decode_loss_metric_and_constant():
    vocab = ["get", "set", "name", "value", "__UNK__", "__EOS__"]
    task = Code2Task(vocab)
    logits = torch.full((2, 5, 6), -5.0)
    for pos, tok in enumerate([0, 2, 5, 1, 1]):
        logits[0, pos, tok] = 5.0
    for pos, tok in enumerate([1, 5, 5, 5, 5]):
        logits[1, pos, tok] = 5.0
    assert task.predict(logits) == [["get", "name"], ["set"]]
    refs = [["get", "name"], ["set", "value"]]
    assert task.score(task.predict(logits), refs) == pytest.approx((1.0 + 2 / 3) / 2)

    class B:
        y = torch.tensor([[0, 2, 5, 5, 5], [1, 3, 5, 5, 5]])
        y_tokens = refs

    assert float(task.loss(logits, B)) > 0
    assert task.targets(B) == refs
    train = [["get", "name"]] * 5 + [["get", "value"]] * 3 + [["set"]] * 2
    assert best_constant_sequence(train)[0] == "get"
    assert 0 < task.constant_baseline(train, refs) < 1
    with pytest.raises(ValueError, match="vocabulary"):
        Code2Task([])


def test_ppa_task_and_task_lookup():
    task = make_task("ppa")
    assert isinstance(task, PPATask)
    out = torch.eye(37)[[3, 4, 5]]
    assert task.predict(out) == [3, 4, 5]
    assert task.score([3, 4, 5], [3, 4, 6]) == pytest.approx(2 / 3)
    assert task.constant_baseline([1, 1, 2], [1, 2, 1, 1]) == pytest.approx(0.75)
    assert task_name_for(None, "ogbg-code2") == "code2"
    assert task_name_for("ppa", "ogbg-code2") == "ppa"


def test_schedule_and_deepspeed_config():
    f = warmup_cosine(total_steps=100, warmup_steps=10)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.5, abs=0.02) and f(99) < 0.01
    assert warmup_cosine(100, 0, cosine=False)(50) == 1.0
    cfg = deepspeed_config(TrainConfig(grad_clip=0.5, zero_stage=1), "bf16", world_size=2)
    assert cfg["gradient_clipping"] == 0.5 and cfg["zero_optimization"]["stage"] == 1
    assert cfg["torch_autocast"]["dtype"] == "bfloat16"
    assert "torch_autocast" not in deepspeed_config(TrainConfig(), "fp32", 1)
    # ZeRO 0: the step clips with one foreach norm (pipeline.train.engine.optimizer_step), not DeepSpeed;
    # partitioned gradients (ZeRO >= 1) and the fp16 loss scaler leave clipping to DeepSpeed
    assert clips_outside_deepspeed(TrainConfig(zero_stage=0), "bf16")
    assert deepspeed_config(TrainConfig(grad_clip=0.5, zero_stage=0), "bf16", 1)["gradient_clipping"] == 0.0
    # DeepSpeed's own default is 1.0: "off" must be said explicitly
    assert deepspeed_config(TrainConfig(grad_clip=0.0, zero_stage=1), "bf16", 2)["gradient_clipping"] == 0.0
    assert not clips_outside_deepspeed(TrainConfig(zero_stage=0), "fp16")
    assert deepspeed_config(TrainConfig(grad_clip=0.5, zero_stage=0), "fp16", 1)["gradient_clipping"] == 0.5
    assert cfg["timers"]["throughput"]["enabled"] is False  # it would synchronise the device every step
    assert resolve_precision("fp32", False) == "fp32"
    with pytest.raises(ValueError, match="fp16"):
        resolve_precision("fp16", use_gpu=False)
    assert resolve_precision("auto", False) in ("bf16", "fp32")
    assert math.isfinite(f(1000))


def test_collective_backend_resolves_to_gloo_where_workers_share_a_gpu():
    from pydantic import ValidationError

    from pipeline.config import load_job
    from pipeline.config.train import ResourcesConfig

    res = ResourcesConfig
    assert res().torch_backend == "gloo"  # CPU workers
    assert res(use_gpu=True, num_workers=4).torch_backend == "nccl"  # a whole GPU each
    assert res(use_gpu=True, num_workers=2, gpus_per_worker=0.5).shares_gpus
    assert res(use_gpu=True, num_workers=2, gpus_per_worker=0.5).torch_backend == "gloo"
    assert res(use_gpu=True, num_workers=1, gpus_per_worker=0.5).torch_backend == "nccl"  # no peer on its device
    assert res(use_gpu=True, num_workers=2, gpus_per_worker=2).torch_backend == "nccl"
    assert res(use_gpu=True, num_workers=4, collective_backend="gloo").torch_backend == "gloo"  # forced
    with pytest.raises(ValidationError, match="NCCL refuses two ranks on one device"):
        res(use_gpu=True, num_workers=2, gpus_per_worker=0.5, collective_backend="nccl")
    with pytest.raises(ValidationError, match="needs GPU workers"):
        res(collective_backend="nccl")
    with pytest.raises(ValidationError):
        res(collective_backend="mpi")
    # as `satp train jobs/code2.yaml --set ...` reads it: two workers sharing the one GPU
    shared = ["resources.num_workers=2", "resources.gpus_per_worker=0.5"]
    assert load_job("jobs/code2.yaml", shared).resources.torch_backend == "gloo"
    assert load_job("jobs/code2.yaml").resources.torch_backend == "nccl"
    with pytest.raises(ValueError, match="collective_backend"):
        load_job("jobs/code2.yaml", shared + ["resources.collective_backend=nccl"])


def test_fit_gives_ray_train_the_resolved_backend(monkeypatch, tmp_path):
    """``pipeline.train.driver._fit`` hands ``resources.torch_backend`` to the TorchTrainer (Ray Train's own
    default would be NCCL for any GPU request). Ray is imported, no cluster is started."""
    rtt = pytest.importorskip("ray.train.torch")
    from pipeline.train import driver as train_mod
    from pipeline.config import load_job
    from pipeline.train.worker_setup import WorkerSetup

    seen = {}

    class Stop(Exception):
        pass

    def trainer(*args, **kwargs):
        seen.update(kwargs)
        raise Stop

    assert issubclass(train_mod._trainer_class(), rtt.TorchTrainer)
    monkeypatch.setattr(train_mod, "_trainer_class", lambda: trainer)
    for sets, backend in ((["resources.num_workers=2", "resources.gpus_per_worker=0.5"], "gloo"), ([], "nccl"),
                          (["resources.use_gpu=false"], "gloo")):
        job = load_job("jobs/code2.yaml", sets + [f"train.storage_path={tmp_path}", "train.run_name=x",
                                                  "mlflow.enabled=false"])
        setup = WorkerSetup(job=job, shard_dir=str(tmp_path), model_config={}, task_name="code2", task_state={},
                            run_id=None)
        with pytest.raises(Stop):
            train_mod._fit(job, setup, None)
        assert seen["torch_config"].backend == backend
        assert seen["scaling_config"].num_workers == job.resources.num_workers


def test_satp_runs_start_no_dataset_manager_and_no_placement_group_cleaner(tmp_path):
    """The controller of a satp run starts neither of Ray Train's two actors a satp run has no use for
    (a process each), and keeps the callbacks that set the workers up; a trainer given Ray Datasets
    keeps the callback that serves them. Ray is imported, no cluster is started."""
    pytest.importorskip("ray.train.torch")
    from ray.train import RunConfig, ScalingConfig

    from pipeline.train import driver as train_mod

    def callbacks(**datasets):
        trainer = train_mod._trainer_class()(lambda: None, scaling_config=ScalingConfig(num_workers=1),
                                             run_config=RunConfig(name="x", storage_path=str(tmp_path)),
                                             datasets=datasets or None)
        return {type(cb).__name__ for cb in trainer._create_default_callbacks()}

    kept = callbacks()
    assert {"AcceleratorSetupCallback", "BackendSetupCallback", "UserCallbackHandler"} <= kept, kept
    assert not kept & {"DatasetsCallback", "PlacementGroupCleanerCallback"}, kept
    # a dataset given as a function that makes it (Ray Train calls it when the workers start)
    assert "DatasetsCallback" in callbacks(train=lambda: None)
