"""Step cost on the CPU: operators per training step and host time per step, eager vs padded vs
compiled. ``BENCH=step make bench`` calls :func:`run`; ``python -m benchmarks.cpu.step [JOB ...]``
prints the table for the given job files (default: ``jobs/pattern.yaml`` and ``jobs/code2.yaml``).

On a GPU a step of SAT costs what the host takes to dispatch its operators (~14 us each, ~3,200 per
PATTERN step: the GPU check's kernel counts), whatever the batch; the CPU shows the same dispatch cost when
the arithmetic is negligible. So each job's own model and task is measured on shards of its layout
(:func:`benchmarks.graphs.jobs.job_shards`) at two batch sizes:

* ``1 graph``: one graph per step (a PATTERN graph has ~118 nodes): the host-bound proxy of the
  GPU's step, where the target is compiled <= 1/3 of eager;
* ``32 graphs``: the paper's batch, where the CPU's arithmetic dominates.

The step is the product's: :class:`pipeline.train.trainer.Trainer` in a
:class:`pipeline.train.context.LocalContext` (its loader with one worker process, its DeepSpeed
engine, fp32), one micro-batch per step, in each ``train.step``:

* ``eager``: the batch as it is;
* ``static``: the batch padded to the run's fixed capacity (:mod:`pipeline.train.capacity`), eager;
* ``compiled``: padded, and the model compiled for that shape.

Figures per row: aten operators dispatched per step from outside another operator (``torch.profiler``
over the third step: from Python, from autograd's engine in the backward pass, or from a compiled
graph's wrapper, i.e. its extern kernels; the compiled graph's own fused kernels are not operators),
median wall ms between the trainer's ``on_step`` calls over the timed steps, and for ``compiled`` the
first two steps' seconds (the compilation; less when Inductor's cache has the graph). Each row runs
in its own process (``torch.set_num_threads(2)``), one after the other on the same machine: ratios
compare within one run only.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
JOBS = ("jobs/pattern.yaml", "jobs/code2.yaml")
MODES = ("eager", "static", "compiled")
SIZES = (1, 32)
TIMED_STEPS = int(os.environ.get("SATP_BENCH_STEP_STEPS", "20"))
WARMUP = 2  # steps before the profiled one (compilation, capacities' first use)


def _job(job_path: str, graphs: int, mode: str, storage: str | Path, sets: tuple[str, ...] = ()):
    from pipeline.config import load_job

    return load_job(ROOT / job_path, [
        f"train.step={mode}", f"train.max_graphs_per_batch={graphs}", f"train.bucket_size={graphs}",
        "train.node_budget=1000000", "train.micro_batches_per_step=1", "train.loader_workers=1", "train.precision=fp32",
        f"train.storage_path={storage}", "resources.use_gpu=false", "resources.num_workers=1",
        "resources.cpus_per_worker=2", "mlflow.enabled=false", *sets])


def shards_for(job_path: str, graphs: int, steps: int, work: Path, sets: tuple[str, ...] = ()) -> str:
    """Shards of the job's layout with enough graphs for :func:`measure`'s steps in one epoch."""
    from benchmarks.graphs.jobs import job_shards

    job = _job(job_path, graphs, "eager", work, sets)
    return str(job_shards(job, work / f"{Path(job_path).stem}-{graphs}-k{job.transform.k_hops}",
                          graphs * (WARMUP + steps + 4)))


class _Stop(Exception):
    pass


def measure(job_path: str, graphs: int, mode: str, shards: str, steps: int = TIMED_STEPS, sets: tuple[str, ...] = (),
            profile: bool = True, max_seconds: float = float("inf")) -> dict:
    """One row: the product's trainer on ``shards`` at ``graphs`` graphs per step, in ``mode`` (``sets``:
    more settings of the job); ``steps`` timed steps, fewer (at least 2) once ``max_seconds`` have passed."""
    import resource

    import numpy as np
    import torch

    from pipeline.train.context import LocalContext
    from pipeline.train.loader import open_split
    from pipeline.train.plan import worker_setup
    from pipeline.train.trainer import Trainer

    torch.manual_seed(0)
    stamps: list[float] = []
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    def on_step(trainer, global_step: int) -> None:
        stamps.append(time.perf_counter())
        if global_step == WARMUP and profile:
            profiler.__enter__()
        elif global_step == WARMUP + 1 and profile:
            profiler.__exit__(None, None, None)
        elif global_step == WARMUP + 2 + steps or (global_step >= WARMUP + 4 and stamps[-1] - stamps[WARMUP + 1] > max_seconds):
            raise _Stop

    with tempfile.TemporaryDirectory(prefix="satp-bench-step-") as tmp:
        (Path(tmp) / "run").mkdir()
        trainer = Trainer(worker_setup(_job(job_path, graphs, mode, tmp, sets), shards), LocalContext(Path(tmp) / "run"),
                          on_step=on_step)
        torch.set_num_threads(2)
        rss_before_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        started = time.perf_counter()
        try:
            trainer.train_epoch(0)
        except _Stop:
            pass
    sizes = np.asarray(open_split(shards, "train").num_nodes)
    times = [1000 * (b - a) for a, b in zip(stamps[WARMUP + 1:], stamps[WARMUP + 2:])]
    return {"job": job_path, "graphs": graphs, "nodes": int(sizes[trainer.batches.step(0, WARMUP)[0]].sum()), "mode": mode,
            "operators": sum(1 for e in profiler.events() if _dispatched(e)) if profile else None,
            "step_ms": statistics.median(times), "steps": len(times), "compile_s": stamps[1] - started,
            "rss_before_training_mb": rss_before_mb, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


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


def in_subprocess(kwargs: dict, timeout: float = 1800, preexec_fn=None) -> dict:
    """:func:`measure` of ``kwargs`` in a fresh process of 2 threads (so that its peak RSS is its own);
    ``{"error": ...}`` when it fails."""
    code = ("import json, sys; from benchmarks.cpu.step import measure; "
            "print('RESULT ' + json.dumps(measure(**json.loads(sys.argv[1]))))")
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # the trainer's LocalContext sets them (a group of one on a free port)
    try:
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(kwargs)], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout, preexec_fn=preexec_fn)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": ((proc.stderr or proc.stdout).strip().splitlines() or [f"exit code {proc.returncode}"])[-1][:300]}
    return json.loads(lines[-1][len("RESULT "):])


def table(jobs=JOBS) -> str:
    rows = ["| job | batch | nodes | step | operators / step | ms / step | vs eager | compile (s) |",
            "|---|---|---|---|---|---|---|---|"]
    work = Path(tempfile.mkdtemp(prefix="satp-bench-step-shards-"))
    try:
        _rows(jobs, work, rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return "\n".join(rows)


def _rows(jobs, work: Path, rows: list[str]) -> None:
    for job_path in jobs:
        for graphs in SIZES:
            eager_ms = None
            shards = shards_for(job_path, graphs, TIMED_STEPS, work)
            for mode in MODES:
                r = in_subprocess(dict(job_path=job_path, graphs=graphs, mode=mode, shards=shards))
                if "error" in r:
                    raise RuntimeError(f"step {job_path} {graphs} {mode} failed: {r['error']}")
                eager_ms = r["step_ms"] if mode == "eager" else eager_ms
                compile_s = f"{r['compile_s']:.0f}" if mode == "compiled" else "-"
                rows.append(f"| {Path(job_path).name} | {graphs} graph{'s' if graphs > 1 else ''} | {r['nodes']} | "
                            f"{mode} | {r['operators']:,} | {r['step_ms']:.1f} | {r['step_ms'] / eager_ms:.2f} | "
                            f"{compile_s} |")
                print(rows[-1], flush=True)


def run() -> str:
    from benchmarks.machine import cpu_flags

    return ("### Step cost: operators and host time per training step, eager vs padded vs compiled (CPU)\n\n"
            f"Command: `BENCH=step make bench` (`benchmarks/cpu/step.py`; {TIMED_STEPS} timed steps per row, "
            f"median; 2 threads; CPU flags: {cpu_flags()}; the product's `Trainer` in a `LocalContext`, fp32, one "
            "micro-batch per step; each row in its own process).\n\n" + table())


if __name__ == "__main__":
    print(table(sys.argv[1:] or JOBS))
