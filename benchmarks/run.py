"""`make bench`: run the benchmark modules and append their figures to benchmarks/RESULTS.md.

Each area's module (:data:`MODULES`; the rooms of :mod:`benchmarks`) exposes ``run() -> str``, a
markdown section with its own command line and figures. ``BENCH=model,preprocessing make bench`` selects areas; the
default is the CPU areas below. ``BENCH=gpu`` is the GPU check (``benchmarks/gpu/run.sh`` runs it on
a bare GPU machine). ``BENCH=scale`` (not in the default) is the scale run of ``satp data synthetic-ppa`` +
``satp preprocess jobs/ppa.yaml`` at the sizes in ``SATP_SCALE_GRAPHS`` (``benchmarks/scale/data_path.py``).
``BENCH=startup`` (not in the default; ~15 min) times ``satp train``'s start-up cold, on a warm ``satp
cluster`` and per trial of a sweep (``benchmarks/cpu/startup.py``). ``BENCH=batch`` (not in the default;
~35-40 min on 2 cores) is the batch-size study: per global batch, an ASHA lr sweep (``satp tune``) and 2
more seeds (``satp compare``), F1 against wall-clock and steps, and the critical batch size
(``benchmarks/accuracy/batch.py``, sizes from ``SATP_BATCH_*``).
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
