"""The worker's training step through the DeepSpeed engine reads nothing back to the host (CUDA only).

Run by the GPU check (`benchmarks/gpu/run.sh`). DeepSpeed cannot be initialised twice in one
process, so the step runs in a subprocess: a DeepSpeed engine from
`pipeline.train.engine.build_engine`, the worker's `TrainStep`, batches from `BatchCollator` in pinned
memory copied without blocking, and `torch.cuda.set_sync_debug_mode("error")` around the steps
(it raises on any synchronising call: DeepSpeed's throughput timer or its own gradient clipping
would).
"""
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import run_one_rank

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r'''
import sys
import torch
from pipeline.train.engine import build_engine, clips_outside_deepspeed
from pipeline.train.loader import BatchCollator, to_device
from pipeline.tasks import Code2Task
from pipeline.config.train import TrainConfig
from pipeline.train.step import TrainStep
from sat import SAT, SATConfig
from benchmarks.graphs.synthetic import code2_like_graphs

precision = sys.argv[1]
torch.manual_seed(0)
vocab = [f"t{i}" for i in range(5000)] + ["__UNK__", "__EOS__"]
task = Code2Task(vocab)
graphs = code2_like_graphs(96, seed=0)
config = task.configure(SATConfig(hidden_dim=64, num_layers=2, num_heads=4, dropout=0.1), graphs[0])
train = TrainConfig(epochs=1, lr=1e-3, grad_clip=1.0)
engine = build_engine(SAT(config), train, precision, steps_per_epoch=3, world_size=1)
step = TrainStep(engine, task, train.grad_clip, clips_outside_deepspeed(train, precision))
collate = BatchCollator(config)
batches = [collate(graphs[i : i + 32]).pin_memory() for i in range(0, 96, 32)]
engine.train()
step(to_device(batches[0], torch.device("cuda")))  # warm-up: lazy initialisation may sync once
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("error")
losses = [step(to_device(b, torch.device("cuda")))[1] for b in batches[1:]]
torch.cuda.set_sync_debug_mode(0)
print("LOSSES", [float(l) for l in losses])
'''


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_worker_step_through_deepspeed_reads_nothing_back(precision):
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", DS_ACCELERATOR="cuda",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = run_one_rank([sys.executable, "-c", SCRIPT, precision], env, 300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [line for line in proc.stdout.splitlines() if line.startswith("LOSSES")]
    assert losses and "nan" not in losses[-1]
