"""Step cost on the CPU: operators per training step and host time per step, eager vs padded vs
compiled (issue 29). ``BENCH=step make bench`` calls :func:`run`; ``python -m benchmarks.cpu.step
[JOB ...]`` prints the table for the given job files (default: ``jobs/pattern.yaml`` and
``jobs/code2.yaml``).

On a GPU a step of SAT costs what the host takes to dispatch its operators (~14 us each, ~3,200 per
PATTERN step: FACTS.md), whatever the batch; the CPU shows the same dispatch cost when the
arithmetic is negligible. So each job's own model (its ``model`` section, its task's encoders and
head; :mod:`benchmarks.graphs.jobs`) is measured on two batches:

* ``1 graph``: one graph of the job's data (a PATTERN graph has ~118 nodes): the host-bound proxy
  of the GPU's step, where the issue's target is compiled <= 1/3 of eager;
* ``32 graphs``: the paper's batch, where the CPU's arithmetic dominates.

and three steps (forward, the task's loss, backward, ``torch.optim.AdamW`` (foreach), as
:class:`pipeline.train.step.TrainStep` runs them, without DeepSpeed's wrappers):

* ``eager``: the batch as it is (today's default);
* ``static``: the batch padded to a fixed capacity (:mod:`sat.padding`), eager;
* ``compiled``: padded, and the model compiled for that shape (``model.compile(dynamic=False)``).

Figures per row: aten operators dispatched per step from outside another operator (``torch.profiler``,
one step: from Python, from autograd's engine in the backward pass, or from a compiled graph's wrapper,
i.e. its extern kernels; the compiled graph's own fused kernels are not operators), median wall ms per
step over the timed steps, and for ``compiled`` the one-time compilation (first two steps) in seconds
(less when Inductor's cache has the graph). Each row runs in
its own process (``torch.set_num_threads(2)``), one after the other on the same machine: ratios
compare within one run only.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
JOBS = ("jobs/pattern.yaml", "jobs/code2.yaml")
MODES = ("eager", "static", "compiled")
SIZES = (1, 32)
TIMED_STEPS = int(os.environ.get("SATP_BENCH_STEP_STEPS", "20"))


def measure(job_path: str, graphs: int, mode: str, steps: int = TIMED_STEPS) -> dict:
    """One row: the job's model on a batch of ``graphs`` graphs, stepped in ``mode``."""
    import torch
    from torch_geometric.data import Batch

    from benchmarks.graphs.jobs import job_graphs
    from pipeline.config import load_job
    from sat import SAT
    from sat.layout import GraphLayout
    from sat.padding import Capacity, batch_counts, pad_batch

    torch.set_num_threads(2)
    torch.manual_seed(0)
    job = load_job(ROOT / job_path)
    items, task, config = job_graphs(job, max(graphs, 4), seed=0)
    cls_token = config.readout == "cls"
    batch = Batch.from_data_list(items[:graphs])
    if mode == "eager":
        batch.graph_layout = GraphLayout.from_sizes(torch.diff(batch.ptr), cls_token=cls_token)
    else:  # room as a capacity chosen from many batches leaves it: a quarter more of everything
        counts = batch_counts(batch)
        grow = {k: (v + v // 4 + 1 if v else 0) for k, v in counts.items()}
        capacity = Capacity(nodes=grow["nodes"] + 1, edges=grow["edges"], graphs=grow["graphs"],
                            graph_nodes=counts["graph_nodes"], subgraph_entries=grow["subgraph_entries"],
                            subgraph_edges=grow["subgraph_edges"])
        batch = pad_batch(batch, capacity, task.node_level, cls_token)
    model = SAT(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    compile_s = 0.0
    if mode == "compiled":
        model.compile(dynamic=False)

    def step() -> None:
        out = model(batch, validate=False)
        task.loss(out, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    start = time.perf_counter()
    for _ in range(2):  # warm-up (and compilation)
        step()
    if mode == "compiled":
        compile_s = time.perf_counter() - start
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    operators = sum(1 for e in prof.events() if _dispatched(e))
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(1000 * (time.perf_counter() - t))
    return {"job": job_path, "graphs": graphs, "nodes": int(batch_counts(batch)["nodes"]), "mode": mode,
            "operators": operators, "step_ms": statistics.median(times), "compile_s": compile_s}


def _dispatched(event) -> bool:
    """Whether a profiler event is an operator dispatched from outside any other operator: from
    Python, autograd's engine (the backward pass) or a compiled graph's wrapper (its extern
    kernels: matmuls, attention). A GPU launches at least one kernel for each."""
    if not event.name.startswith("aten::"):
        return False
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return False
        parent = parent.cpu_parent
    return True


def _in_subprocess(job_path: str, graphs: int, mode: str) -> dict:
    code = ("import json, sys; from benchmarks.cpu.step import measure; "
            "print('RESULT ' + json.dumps(measure(sys.argv[1], int(sys.argv[2]), sys.argv[3])))")
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code, job_path, str(graphs), mode], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"bench_step {job_path} {graphs} {mode} failed: {proc.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def table(jobs=JOBS) -> str:
    rows = ["| job | batch | nodes | step | operators / step | ms / step | vs eager | compile (s) |",
            "|---|---|---|---|---|---|---|---|"]
    for job_path in jobs:
        for graphs in SIZES:
            eager_ms = None
            for mode in MODES:
                r = _in_subprocess(job_path, graphs, mode)
                eager_ms = r["step_ms"] if mode == "eager" else eager_ms
                compile_s = f"{r['compile_s']:.0f}" if mode == "compiled" else "-"
                rows.append(f"| {Path(job_path).name} | {graphs} graph{'s' if graphs > 1 else ''} | {r['nodes']} | "
                            f"{mode} | {r['operators']:,} | {r['step_ms']:.1f} | {r['step_ms'] / eager_ms:.2f} | "
                            f"{compile_s} |")
                print(rows[-1], flush=True)
    return "\n".join(rows)


def run() -> str:
    from benchmarks.machine import cpu_flags

    return ("### Step cost: operators and host time per training step, eager vs padded vs compiled (CPU)\n\n"
            f"Command: `BENCH=step make bench` (`benchmarks/cpu/step.py`; {TIMED_STEPS} timed steps per row, "
            f"median; 2 threads; CPU flags: {cpu_flags()}; forward + the task's loss + backward + AdamW foreach, "
            "no DeepSpeed; each row in its own process).\n\n" + table())


if __name__ == "__main__":
    print(table(sys.argv[1:] or JOBS))
