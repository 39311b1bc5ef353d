"""`make bench`: run the benchmark modules and put their sections into benchmarks/RESULTS.md.

Each area's module (:data:`MODULES`) exposes ``run() -> str``, a markdown section with its own command
line and figures. It replaces the area's section of RESULTS.md (:data:`HEADINGS`), which holds the current
tables only (their history is git's), or is added at the end.
``BENCH=model,preprocessing make bench`` selects areas; the default is :data:`AREAS`.
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
#: ``BENCH`` area -> the heading of its section in RESULTS.md
HEADINGS = {
    "model": "## Model: SAT train step on code2-shaped batches (CPU)", "preprocessing": "## Preprocessing (CPU)",
    "training": "## Training (CPU)", "loader": "## Loader (CPU)", "step": "## Step cost: eager, padded, compiled (CPU)",
    "startup": "## Start-up", "scale": "## Scale: ogbg-ppa and a code2-scale corpus (CPU)",
    "batch": "## Batch size: time and steps to accuracy (CPU)", "gpu": "## GPU check (H100)",
}
AREAS = ("model", "preprocessing", "training", "loader", "step")  # `make bench` without BENCH


def main() -> int:
    selected = [a for a in os.environ.get("BENCH", ",".join(AREAS)).split(",") if a]
    sections = {}
    unknown = [a for a in selected if a not in MODULES]
    if unknown:
        raise SystemExit(f"BENCH: unknown area(s) {unknown}; expected some of {', '.join(MODULES)}")
    for area in selected:
        module = importlib.import_module(MODULES[area])
        print(f"== benchmark: {area}", flush=True)
        sections[area] = module.run()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    results = HERE / "RESULTS.md"
    text = results.read_text()
    for area, body in sections.items():
        section = f"{HEADINGS[area]}\nMeasured {stamp} (commit {commit}); machine: {describe()}.\n\n{body.strip()}\n"
        text = replace_section(text, HEADINGS[area], section)
        print(section)
    results.write_text(text)
    return 0


def replace_section(text: str, heading: str, section: str) -> str:
    """``text`` with the level-2 section titled ``heading`` (up to the next ``## ``) replaced by
    ``section``, or with ``section`` added at the end when there is none."""
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.rstrip("\n") == heading]
    if not starts:
        return text.rstrip("\n") + "\n\n" + section
    end = next((i for i in range(starts[0] + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "".join(lines[:starts[0]]) + section + "\n" + "".join(lines[end:])


if __name__ == "__main__":
    sys.exit(main())
