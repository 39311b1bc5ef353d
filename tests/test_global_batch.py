"""The global batch (pipeline.train.global_batch): steps that are the same at any worker count.

Below Ray: the sequence, the steps and their shares (pure functions of seed, epoch and step); and
the gradient itself, with real DeepSpeed engines (ZeRO stage 0, fp32) on a real gloo process group
of 3 processes, each rank accumulating its share of a step of 4 (2/1/1) or 2 (1/1/0) micro-batches:
the gradient DeepSpeed steps with equals the mean over the step's graphs computed in plain
PyTorch, and the step's loss summed over the ranks equals the mean loss.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.train.batching import NodeBudgetSampler
from pipeline.train.global_batch import GlobalBatches, Position, RankStream, share
from runtime.ports import free_ports

ROOT = Path(__file__).resolve().parents[1]


def _sizes(n=600, seed=0):
    return np.random.default_rng(seed).integers(5, 120, n)


def _batches(k: int, per_node: bool = False, seed: int = 3) -> GlobalBatches:
    return GlobalBatches(NodeBudgetSampler(_sizes(), 500, seed=seed, bucket_size=64), k, per_node=per_node)


@pytest.mark.parametrize("k", [1, 3, 4])
def test_steps_and_their_micro_batches_do_not_depend_on_the_worker_count(k):
    plan = _batches(k)
    assert plan.steps_per_epoch == len(plan.sampler.global_batches(0)) // k  # fixed by the first epoch
    for epoch in range(3):
        assert len(plan.epoch(epoch)) == plan.steps_per_epoch * k  # later epochs trimmed or repeated to fit
        for step in (0, plan.steps_per_epoch - 1):
            micro = plan.step(epoch, step)
            again = _batches(k).step(epoch, step)  # a fresh object (another process): the same step
            assert all(np.array_equal(a, b) for a, b in zip(micro, again))
            for world in range(1, k + 3):
                dealt = [j for rank in range(world) for j in share(k, rank, world)]
                assert sorted(dealt) == list(range(k))  # every micro-batch once, whatever the count
                scales = [s for rank in range(world) for s in plan.scales(epoch, step, rank, world)]
                # each rank's sum, averaged by DeepSpeed over the ranks: weights summing to 1
                assert sum(scales) / world == pytest.approx(1.0)
    assert [len(share(3, r, 2)) for r in range(2)] == [2, 1] and [len(share(2, r, 3)) for r in range(3)] == [1, 1, 0]
    assert not np.array_equal(np.concatenate(plan.step(0, 0)), np.concatenate(plan.step(1, 0)))  # reshuffled


def test_scales_weigh_micro_batches_by_their_graphs_or_nodes():
    for per_node in (False, True):
        plan = _batches(3, per_node=per_node)
        micro = plan.step(2, 1)
        units = [plan.sampler.sizes[m].sum() if per_node else len(m) for m in micro]
        assert plan.scales(2, 1, 0, 1) == pytest.approx([u / sum(units) for u in units])
        assert plan.scales(2, 1, 1, 2) == pytest.approx([2 * units[1] / sum(units)])


def test_a_step_checkpoint_resumed_at_another_worker_count_takes_the_same_next_global_batch():
    """Two workers stop after step 5 of epoch 1 (the checkpoint's position); three, or one, resume
    there: what their streams take next is the global batch of step 6, then step 7, ..."""
    plan = _batches(3)
    position = Position(1, 6)
    for world in (1, 2, 3, 4):
        streams = [iter(RankStream(plan, rank, world, position)) for rank in range(world) if share(3, rank, world)]
        for step in (6, 7):
            taken = [next(s) for rank, s in enumerate(streams) for _ in share(3, rank, world)]
            order = [j for rank in range(len(streams)) for j in share(3, rank, world)]
            expected = plan.step(1, step)
            assert all(np.array_equal(taken[i], expected[j]) for i, j in enumerate(order))
    with pytest.raises(ValueError, match="takes none"):
        next(iter(RankStream(plan, 3, 4, position)))  # 4 workers, 3 micro-batches: rank 3 never reads


SCRIPT = r'''
import json, sys
import numpy as np
import torch
from torch_geometric.data import Batch
from sat import SAT, SATConfig, SATData
from pipeline.config.train import TrainConfig
from pipeline.tasks import PPATask
from pipeline.train.batching import NodeBudgetSampler
from pipeline.train.engine import build_engine, clips_outside_deepspeed
from pipeline.train.global_batch import GlobalBatches, share
from pipeline.train.reporting import StepLosses
from pipeline.train.step import TrainStep

rank, world = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
gen = torch.Generator().manual_seed(0)
def graph(n):
    src = torch.arange(1, n)
    dst = torch.tensor([int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)])
    ei = torch.cat([torch.stack([dst, src]), torch.stack([src, dst])], 1)
    return SATData(x=torch.zeros(n, dtype=torch.long), edge_index=ei, edge_attr=torch.rand(ei.size(1), 7, generator=gen),
                   y=torch.randint(0, 37, (1,), generator=gen), num_nodes=n)
graphs = [graph(int(n)) for n in torch.randint(4, 30, (40,), generator=gen)]
task = PPATask()
config = task.configure(SATConfig(hidden_dim=16, num_layers=1, num_heads=2, dropout=0.0), graphs[0])
results = []
for k in map(int, sys.argv[3].split(",")):  # one engine per global batch, on the one process group
    plan = GlobalBatches(NodeBudgetSampler(np.array([g.num_nodes for g in graphs]), 120, seed=5), k)
    micro = [Batch.from_data_list([graphs[i] for i in ids]) for ids in plan.step(0, 0)]
    torch.manual_seed(0)
    reference = SAT(config)  # the mean loss over the step's graphs, in plain PyTorch
    units = [m.num_graphs for m in micro]
    loss = sum(task.loss(reference(m), m) * u / sum(units) for m, u in zip(micro, units))
    loss.backward()
    expected = torch.cat([p.grad.flatten() for p in reference.parameters()])

    torch.manual_seed(0)
    train = TrainConfig(micro_batches_per_step=k, grad_clip=0.0, lr=1e-3)
    engine = build_engine(SAT(config), train, "fp32", plan.steps_per_epoch, world)
    seen = {}
    def record_then_step(*args, step_engine=engine.step, engine=engine, **kwargs):  # the gradient DeepSpeed steps with
        seen["grad"] = torch.cat([p.grad.flatten() for p in engine.module.parameters()])
        return step_engine(*args, **kwargs)
    engine.step = record_then_step
    step = TrainStep(engine, task, train.grad_clip, clips_outside_deepspeed(train, "fp32"))
    losses = StepLosses()
    mine = share(k, rank, world)
    part = torch.zeros(())
    for index, (j, scale) in enumerate(zip(mine, plan.scales(0, 0, rank, world))):
        _, l = step.accumulate(micro[j], scale, index, len(mine))
        part += l * scale / world
    step.finish()
    losses.add(1, part)
    [[_, step_loss]] = losses.take()
    results.append({"k": k, "error": float((seen["grad"] - expected).abs().max()), "scale": float(expected.abs().max()),
                    "loss": step_loss, "expected_loss": float(loss.detach()), "share": len(mine)})
# every rank done with its collectives, then the group ended, before any process exits: a rank that
# left with gloo's threads still running ended in std::terminate (status -6, seen once in a suite)
torch.distributed.barrier()
torch.distributed.destroy_process_group()
print("RESULT " + json.dumps(results))
'''


def test_deepspeed_steps_with_the_mean_gradient_of_the_step_at_any_worker_count():
    """3 ranks (a gloo group of 3 processes), steps of 4 micro-batches (shares 2/1/1) and of 2
    (1/1/0: a rank with nothing to accumulate joins the reduction with zero gradients): DeepSpeed's
    reduced gradient, the one its optimizer steps with, equals the gradient of the step's mean loss
    over its graphs in plain PyTorch. fp32 through a 1-layer model, the same products summed in
    another order: seen within ~1e-5 of the largest component; 1e-4 bounds it, while a share scaled
    wrongly (a missing factor of the worker count, one micro-batch weighted by another's graphs) is
    off by a large part of the gradient itself."""
    world, ks = 3, (4, 2)
    port = free_ports(1)[0]
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", SCRIPT, str(rank), str(world), ",".join(map(str, ks))],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    ranks = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=600)
            assert proc.returncode == 0, out[-3000:]
            ranks.append(json.loads(out.split("RESULT ", 1)[1].splitlines()[0]))
    finally:
        for proc in procs:  # one rank failing leaves the others waiting in a collective
            proc.kill()
    for i, k in enumerate(ks):
        assert [r[i]["share"] for r in ranks] == [len(share(k, rank, world)) for rank in range(world)]
        for r in ranks:
            assert r[i]["error"] <= 1e-4 * r[i]["scale"], r[i]
            assert r[i]["loss"] == pytest.approx(r[i]["expected_loss"], rel=1e-5)
