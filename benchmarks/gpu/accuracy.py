"""GPU check, parts ``pattern``, ``cluster`` and ``code2batch`` (``benchmarks/gpu/run.sh PART``): time to
accuracy on one GPU through ``satp train`` as a user runs it (docs/gpu.md, "Time to accuracy on one GPU").

``pattern`` / ``cluster`` (:mod:`~benchmarks.gpu.accuracy_sbm`): the job file on the full benchmark
generated on the machine, ``train.target`` on the validation accuracy; the section gives the time to
target, the test accuracy at the best validation epoch (the targets: PATTERN >= 86.5 within 5 minutes,
CLUSTER >= 77.4 within 10) and the per-epoch curve. ``code2batch`` (:mod:`~benchmarks.gpu.accuracy_code2`):
the paper's code2 recipe (32 graphs per step, lr 1e-4) for 3 epochs against ``jobs/code2.yaml``'s default
batch and lr, to the recipe's validation F1. Each part works in ``SATP_ACC_DIR`` (default
``runs/gpu-PART``): data and shards are made once, runs have fixed names, so a second call on the same
warm machine resumes a run the first call's budget cut. What the parts share:
:mod:`~benchmarks.gpu.accuracy_runs` (budget, ledger, ``satp train`` under a watch) and
:mod:`~benchmarks.gpu.accuracy_report` (curve table, plot). ``SATP_GPU_DRY_RUN=1``: a few hundred
graphs, a tiny model, CPU workers, through the same commands and code.
"""
from __future__ import annotations

from typing import Optional

from benchmarks.gpu.accuracy_code2 import run_code2batch
from benchmarks.gpu.accuracy_runs import PART
from benchmarks.gpu.accuracy_sbm import run_sbm

PARTS = ("pattern", "cluster", "code2batch")


def run(part: Optional[str] = None) -> str:
    part = part or PART
    if part not in PARTS:
        raise SystemExit(f"SATP_GPU_PART={part!r}: expected one of {', '.join(PARTS)}")
    return run_code2batch() if part == "code2batch" else run_sbm(part)


if __name__ == "__main__":
    print(run())
