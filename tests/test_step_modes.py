"""``train.step``: eager, static (padded), compiled and captured steps through the DeepSpeed engine
compute the same training run (pipeline.train.step, pipeline.train.cuda_graphs).

DeepSpeed cannot be initialised again after its process group is destroyed: the modes'
runs share one subprocess, an engine each.
On the CPU: the same losses, eager on the batches as they come vs static and compiled on the same
batches padded to one capacity (compiled with ``aot_eager``: see tests/test_compile.py), a batch
over the capacity run eagerly and counted, and one compiled graph for all padded batches. The
CUDA-graph capture itself runs only on a GPU (skipped here): captured vs eager over 50 bf16 steps.
On the CPU, what a captured step does around the capture is checked: a padded batch copied into
the captured batch's tensors gives the model the new batch.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import run_one_rank

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r'''
import json, sys
import torch
from torch_geometric.data import Batch
from torch._dynamo.utils import counters
from benchmarks.graphs.jobs import job_graphs
from pipeline.config import load_job
from pipeline.config.train import TrainConfig
from pipeline.train.engine import build_engine, clips_outside_deepspeed
from pipeline.train.step import TrainStep
from sat import SAT
from sat.layout import GraphLayout
from sat.padding import Capacity, batch_counts, pad_batch

modes, device, precision, steps = sys.argv[1].split(","), torch.device(sys.argv[2]), sys.argv[3], int(sys.argv[4])
job = load_job("jobs/pattern-local.yaml", ["model.hidden_dim=16", "model.num_heads=2", "model.num_layers=2",
                                           "model.dropout=0.0"])
graphs, task, config = job_graphs(job, 14, seed=0)
plain = [Batch.from_data_list(graphs[i:i + 3]) for i in range(0, 12, 3)] + [Batch.from_data_list(graphs[:7])]
counts = [batch_counts(b) for b in plain[:4]]
top = {k: max(c[k] for c in counts) for k in counts[0]}
capacity = Capacity(nodes=top["nodes"] + 5, edges=top["edges"] + 9, graphs=3, graph_nodes=top["graph_nodes"])
for b in plain:
    b.graph_layout = GraphLayout.from_sizes(torch.diff(b.ptr))
# the last batch (7 graphs) is over the capacity: it runs eagerly in every mode
padded = [pad_batch(b, capacity, node_targets=True) if b.num_graphs <= 3 else b for b in plain]
results = {}
for mode in modes:  # one engine per mode, in one process (DeepSpeed initialises its process group once)
    torch.manual_seed(0)
    train = TrainConfig(epochs=1, lr=1e-3, grad_clip=1.0, warmup_epochs=0)
    engine = build_engine(SAT(config).to(device), train, precision, steps_per_epoch=steps, world_size=1)
    if mode == "compiled" and device.type == "cpu":
        engine.compile(backend="aot_eager", compile_kwargs={"dynamic": False})
    elif mode in ("compiled", "captured"):
        engine.compile(compile_kwargs={"dynamic": False})
    step = TrainStep(engine, task, train.grad_clip, clips_outside_deepspeed(train, precision), mode=mode, device=device)
    batches = plain if mode == "eager" else padded
    torch._dynamo.reset()
    counters.clear()
    engine.train()
    losses = [float(step(batches[i % len(batches)])[1]) for i in range(steps)]
    results[mode] = {"losses": losses, "overflow": step.overflow, "graphs": counters["stats"]["unique_graphs"]}
print("RESULT " + json.dumps(results))
'''


def _run(modes: list[str], device: str, precision: str, steps: int) -> dict:
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", DS_ACCELERATOR=device,
               OMP_NUM_THREADS="2", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = run_one_rank([sys.executable, "-c", SCRIPT, ",".join(modes), device, precision, str(steps)], env, 900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_static_and_compiled_steps_train_as_the_eager_step():
    runs = _run(["eager", "static", "compiled"], "cpu", "fp32", steps=10)
    for mode in ("static", "compiled"):
        torch.testing.assert_close(runs[mode]["losses"], runs["eager"]["losses"], rtol=1e-4, atol=1e-5, msg=mode)
        assert runs[mode]["overflow"] == 2  # the 7-graph batch, twice in 10 steps
    assert runs["eager"]["overflow"] == 0
    assert runs["compiled"]["graphs"] == 1  # every padded batch ran the one compiled graph


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_step_matches_the_eager_step_over_50_steps():
    runs = _run(["eager", "captured"], "cuda", "bf16", steps=50)
    eager, captured = runs["eager"], runs["captured"]
    assert captured["overflow"] == 10
    for a, b in zip(captured["losses"], eager["losses"]):
        assert abs(a - b) <= 0.05 * abs(b) + 1e-3, (captured["losses"], eager["losses"])


def test_a_padded_batch_copied_into_the_captured_inputs_is_what_the_model_sees():
    """What a replay reads: the captured batch's tensors, overwritten with the next batch's."""
    from torch_geometric.data import Batch

    from benchmarks.graphs.jobs import job_graphs
    from pipeline.config import load_job
    from pipeline.train.cuda_graphs import batch_tensors, copy_into
    from sat import SAT
    from sat.padding import Capacity, pad_batch

    job = load_job(ROOT / "jobs" / "code2-local.yaml", ["model.hidden_dim=16", "model.num_heads=2",
                                                         "model.num_layers=1", "model.readout=cls"])
    graphs, task, config = job_graphs(job, 6, seed=3)
    capacity = Capacity(nodes=2000, edges=6000, graphs=4, graph_nodes=1000)
    first, second = (pad_batch(Batch.from_data_list(graphs[i:i + 3]), capacity, task.node_level, cls_token=True)
                     for i in (0, 3))
    model = SAT(config).eval()
    with torch.no_grad():
        want = model(second, validate=False)
        static = batch_tensors(first)
        copy_into(static, second)
        got = model(first, validate=False)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    other = pad_batch(Batch.from_data_list(graphs[:2]), Capacity(nodes=2001, edges=6000, graphs=4, graph_nodes=1000),
                      task.node_level, cls_token=True)
    with pytest.raises(ValueError, match="another capacity"):
        copy_into(static, other)
