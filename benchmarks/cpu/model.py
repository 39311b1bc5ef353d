"""Model benchmark: SAT train-step throughput and peak memory on code2-shaped batches (``BENCH=model make bench``).

Each configuration (:data:`CONFIGS`) in a fresh process (so that its peak RSS is its own): the product's
step (:func:`benchmarks.cpu.step.measure`: its ``Trainer`` in a ``LocalContext``) on shards of synthetic
code2-shaped graphs (:func:`benchmarks.graphs.jobs.job_shards`), 32 graphs per step, with the model of
``jobs/code2.yaml`` at the paper's FFN 4x (4 layers, hidden 256, 4 heads, dropout 0.2, k=2 GCN extractor
with edge features, mean readout, 5 heads of 5002 classes), AdamW, 2 threads; the figure is the median
step time after warm-up, as graphs/s, against the SAT authors' code on the same kind of machine.
"""
from __future__ import annotations

import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.cpu import step

JOB = "jobs/code2.yaml"
GRAPHS_PER_BATCH = 32
DENSE, BF16, SUBGRAPH = "fp32, k-subtree", "bf16 autocast, k-subtree", "fp32, k-subgraph (k=2)"
# (label, precision, extractor, timed steps, seconds after which at least 2 suffice)
CONFIGS = [(DENSE, "fp32", "subtree", 8, 60), (BF16, "bf16", "subtree", 8, 60), (SUBGRAPH, "fp32", "subgraph", 4, 60)]
TIME_BUDGET_S = 450.0  # the whole run stays under ~8 minutes; later rows are skipped or cut
REFERENCE = ("the SAT authors' code on a 2-core CPU, their loader, 32 graphs per batch: dense fp32 8.4 graphs/s (6.1 GB), "
             "bf16 13.4 graphs/s, k-subgraph 3.0 graphs/s (8.6 GB)")


def _sets(precision: str, extractor: str) -> tuple[str, ...]:
    return (f"train.precision={precision}", f"model.extractor={extractor}",
            "model.ffn_ratio=4.0", f"transform.k_hops={2 if extractor == 'subgraph' else 0}")


def _memory_guard() -> None:
    """Cap the child's address space below the machine's available memory: on a shared machine a row that
    needs more fails alone instead of OOM-killing others."""
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    avail = next((int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:")), None)
    if avail:
        limit = max(4 << 30, avail - (3 << 29))
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def run() -> str:
    """Every configuration, each in a fresh process; a markdown section."""
    rows, by_label = [], {}
    load_start, start = os.getloadavg()[0], time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="satp-bench-model-"))
    for label, precision, extractor, steps, max_seconds in CONFIGS:
        left = TIME_BUDGET_S - (time.perf_counter() - start)
        if left < 30:
            rows.append(f"| {label} | skipped (benchmark time budget spent) | | | |")
            continue
        print(f"   model bench: {label} ...", flush=True)
        sets = _sets(precision, extractor)
        r = step.in_subprocess(dict(job_path=JOB, graphs=GRAPHS_PER_BATCH, mode="eager", steps=steps, sets=sets,
                                    shards=step.shards_for(JOB, GRAPHS_PER_BATCH, 8, work, sets), profile=False,
                                    max_seconds=max_seconds), timeout=min(360.0, left), preexec_fn=_memory_guard)
        print(f"   {r}", flush=True)
        if "error" in r:
            rows.append(f"| {label} | failed: {r['error']} | | | |")
            continue
        r["graphs_per_s"] = GRAPHS_PER_BATCH * 1000 / r["step_ms"]
        by_label[label] = r
        rows.append(f"| {label} | {r['step_ms'] / 1000:.3f} | {r['graphs_per_s']:.1f} | {r['peak_rss_mb'] / 1024:.2f} | {r['steps']} |")
    shutil.rmtree(work, ignore_errors=True)
    lines = ["### Model: SAT train step on code2-shaped batches", "",
             f"Command: `BENCH=model make bench`. {GRAPHS_PER_BATCH} random synthetic code2-shaped graphs per step "
             "(`benchmarks/graphs/jobs.py`, seed 0); the model of `jobs/code2.yaml` with FFN 4x (4 layers, hidden 256, "
             "4 heads, dropout 0.2, k=2 GCN extractor with edge features, mean readout, 5 x 5002-class heads), AdamW, "
             "2 threads. Step = the product's trainer step (`benchmarks/cpu/step.py`: `Trainer` in a `LocalContext`, "
             "DeepSpeed); median after warm-up; each row in a fresh process (peak RSS = ru_maxrss of that process). "
             f"Load average (1 min) at start: {load_start:.1f}, at end: {os.getloadavg()[0]:.1f}.", "",
             "| configuration | median step (s) | graphs/s | peak RSS (GB) | steps timed |", "|---|---|---|---|---|", *rows, ""]
    dense, bf16 = by_label.get(DENSE), by_label.get(BF16)
    if bf16 and dense:
        lines.append(f"bf16 autocast / fp32 (dense): {bf16['graphs_per_s'] / dense['graphs_per_s']:.2f}x.")
    return "\n".join(lines + [f"Reference: {REFERENCE}."])


if __name__ == "__main__":
    print(run())
