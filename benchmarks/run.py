"""`make bench`: run the benchmark modules and append their sections to benchmarks/RESULTS.md.

Each area's module (:data:`MODULES`) exposes ``run() -> str``, a markdown section with its own command
line and figures. ``BENCH=model,preprocessing make bench`` selects areas; the default is :data:`AREAS`.
Not in the default: ``startup`` (~15 min), ``scale`` (sizes from ``SATP_SCALE_GRAPHS``), ``batch`` (the
batch-size study, ~35-40 min on 2 cores, ``SATP_BATCH_*``) and ``gpu`` (the GPU check;
``benchmarks/gpu/run.sh`` runs it on a bare GPU machine).
"""
from __future__ import annotations

import datetime
import importlib
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.machine import describe

HERE = Path(__file__).resolve().parent
#: ``BENCH`` area -> the module whose ``run()`` returns its section; the default areas first
MODULES = {
    "model": "benchmarks.cpu.model", "preprocessing": "benchmarks.cpu.preprocessing",
    "training": "benchmarks.cpu.training", "loader": "benchmarks.cpu.loader", "step": "benchmarks.cpu.step",
    "startup": "benchmarks.cpu.startup", "scale": "benchmarks.scale.data_path", "batch": "benchmarks.accuracy.batch", "gpu": "benchmarks.gpu.check",
}
AREAS = ("model", "preprocessing", "training", "loader", "step")  # `make bench` without BENCH


def main() -> int:
    selected = [a for a in os.environ.get("BENCH", ",".join(AREAS)).split(",") if a]
    sections = []
    unknown = [a for a in selected if a not in MODULES]
    if unknown:
        raise SystemExit(f"BENCH: unknown area(s) {unknown}; expected some of {', '.join(MODULES)}")
    for area in selected:
        module = importlib.import_module(MODULES[area])
        print(f"== benchmark: {area}", flush=True)
        sections.append(module.run())
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    text = f"\n## {stamp} (commit {commit})\nMachine: {describe()}\n\n" + "\n\n".join(sections) + "\n"
    with open(HERE / "RESULTS.md", "a") as fh:
        fh.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
