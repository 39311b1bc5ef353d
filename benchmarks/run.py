"""`make bench`: run the benchmark modules and append their figures to benchmarks/RESULTS.md.

Each ``benchmarks/bench_<area>.py`` exposes ``run() -> str``, a markdown section with
its own command line and figures. ``BENCH=model,preprocessing make bench`` selects areas; the
default is the CPU areas below. ``BENCH=gpu`` is the GPU check (``benchmarks/gpu/run.sh`` runs it on
a bare GPU machine). ``BENCH=scale`` (not in the default) is the scale run of ``satp data synthetic-ppa`` +
``satp preprocess jobs/ppa.yaml`` at the sizes in ``SATP_SCALE_GRAPHS`` (``benchmarks/bench_scale.py``).
``BENCH=batch`` (not in the default; ~35-40 min on 2 cores) is the batch-size study of issue 20: per global
batch, an ASHA lr sweep (``satp tune``) and 2 more seeds (``satp compare``), F1 against wall-clock and steps,
and the critical batch size (``benchmarks/bench_batch.py``, sizes from ``SATP_BATCH_*``).
"""
from __future__ import annotations

import datetime
import importlib
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
AREAS = ("model", "preprocessing", "training", "loader", "step")


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        gpu = "none"
    import torch

    return f"{cpu}, {os.cpu_count()} cores, GPU: {gpu}, Python {platform.python_version()}, torch {torch.__version__}"


def main() -> int:
    selected = [a for a in os.environ.get("BENCH", ",".join(AREAS)).split(",") if a]
    sections = []
    for area in selected:
        module = importlib.import_module(f"benchmarks.bench_{area}")
        print(f"== benchmark: {area}", flush=True)
        sections.append(module.run())
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    text = f"\n## {stamp} (commit {commit})\nMachine: {machine()}\n\n" + "\n\n".join(sections) + "\n"
    with open(HERE / "RESULTS.md", "a") as fh:
        fh.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
