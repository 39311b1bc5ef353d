"""Batch-size study (time to accuracy against the global batch): ``BENCH=batch .venv/bin/python -m benchmarks.run``
(or ``python -m benchmarks.accuracy.batch``, which prints the section without appending it).

The question: the GPU job's global batch (~2,070 graphs per step over 4 workers, 65x the paper's 32)
with a learning rate from the square-root rule. Here, on CPU, with the model of ``jobs/code2-local.yaml``
on the offline Python-source data, for global batches of G graphs (``SATP_BATCH_SIZES``, default
32,128,512,2048):

1. an ASHA sweep of ``train.lr`` per G through the product's own machinery (``satp tune`` on a job
   made from ``jobs/code2-batch-local.yaml``: one Ray Train worker per trial, ``max_graphs_per_batch: G``
   and ``bucket_size: G`` so that every step takes G random graphs), the grid
   ``SATP_BATCH_LR_FACTORS`` x lr_32 x sqrt(G / 32) (the square-root rule's value first, so that ASHA
   compares the others with it);
2. the sweep's best lr again with the seeds ``SATP_BATCH_SEEDS`` (default 1,2; the sweep's trial is
   seed 0) through ``satp compare`` (variants x seeds, no scheduler);
3. from the trials' Train checkpoints (``state.json`` history: ``val_f1``, ``test_f1``, ``steps``,
   ``elapsed_s`` per epoch): the table, F1 against wall-clock and against optimizer steps
   (``docs/figures/batch_f1_vs_time.png``, ``docs/figures/batch_f1_vs_steps.png``), the steps and
   seconds to a validation F1 that every batch size reaches, and the critical batch size.

Every G trains on the same graphs for the same epochs (``SATP_BATCH_TRAIN`` training functions,
``SATP_BATCH_EPOCHS`` epochs; a cosine schedule with a warm-up of 10% of training), so a larger G takes
proportionally fewer steps. The sizes run in ``SATP_BATCH_LANES`` (default 2) lanes side by side, one
CPU each: each lane runs the sweep and then the seeds of its sizes, one trial at a time.

Everything lives under ``SATP_BATCH_DIR`` (default ``runs/batch-study``): the dataset (built once by
``satp data pycode``), the shards, the generated job files, the Tune / Train storage, one MLflow SQLite
database per lane (experiment ``satp-batch-study``) and the logs. A rerun with the same settings finds
the finished sweeps and comparisons (the product's reruns: nothing trains again) and only reports;
``SATP_BATCH_REPORT_ONLY=1`` reports from what is there without running anything.

Critical batch size: with S(G) the optimizer steps to the common validation F1 target, perfect
scaling gives S(4G) = S(G) / 4 (the sizes are 4x apart). The empirical model of McCandlish et al.
(2018), S(G) = S_min (1 + G_crit / G), is fitted by least squares of S on 1/G; G_crit is the batch at
which twice the minimal number of steps is needed (and twice the minimal number of graphs seen), i.e.
beyond which doubling the batch saves less than a third of the steps.

This module runs the study and is its entry point (:func:`run`); the settings and job files are in
:mod:`benchmarks.accuracy.batch_jobs`, the reading and analysis of the runs in
:mod:`benchmarks.accuracy.batch_analysis`, the figures and the section in :mod:`benchmarks.accuracy.batch_report`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.accuracy.batch_analysis import analyse, best_trial, read_sweep
from benchmarks.accuracy.batch_jobs import ROOT, base_dict, lanes_of, seeds_job, settings, sweep_job, write_job
from benchmarks.accuracy.batch_report import plot, section


# ----------------------------------------------------------------------------- running
def _env() -> dict:
    env = dict(os.environ, OUTDATED_IGNORE="1", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)  # each lane starts its own local Ray
    return env


def _satp() -> list[str]:
    return [sys.executable, "-m", "pipeline.cli"]


def run_logged(cmd: list[str], log: Path, timings: dict, key: str) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log, "ab") as fh:
        fh.write(("$ " + " ".join(cmd) + "\n").encode())
        fh.flush()
        rc = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=fh, stderr=subprocess.STDOUT).returncode
    timings[key] = time.perf_counter() - started
    print(f"== batch: {key} exited {rc} after {timings[key]:.0f} s", file=sys.stderr, flush=True)
    return rc


def prepare(cfg: dict, timings: dict) -> None:
    """The dataset (once) and the shards (once, before the lanes: they would build the same directory)."""
    d = cfg["dir"]
    if not (d / "data" / "ogbg_code2").exists():
        rc = run_logged([*_satp(), "data", "pycode", "--out", str(d / "data")], d / "logs" / "data.log", timings, "data")
        if rc:
            raise RuntimeError(f"satp data pycode failed (see {d / 'logs' / 'data.log'})")
    job = write_job(base_dict(cfg, cfg["sizes"][0], 0), d / "jobs" / "preprocess.yaml")
    rc = run_logged([*_satp(), "preprocess", str(job), "--no-progress"], d / "logs" / "preprocess.log", timings,
                    "preprocess")
    if rc:
        raise RuntimeError(f"satp preprocess failed (see {d / 'logs' / 'preprocess.log'})")


def run_lane(cfg: dict, lane: int, sizes: list[int], timings: dict, errors: list) -> None:
    d = cfg["dir"]
    for g in sizes:
        try:
            job = write_job(sweep_job(cfg, g, lane), d / "jobs" / f"sweep-g{g}.yaml")
            log = d / "logs" / f"sweep-g{g}.log"
            if run_logged([*_satp(), "tune", str(job)], log, timings, f"sweep g{g}"):
                errors.append(f"G={g}: satp tune failed (see {log})")
            sweep = read_sweep(cfg, g)
            best = best_trial(sweep)
            if best is None:
                errors.append(f"G={g}: no trial of the sweep finished")
                continue
            job = write_job(seeds_job(cfg, g, lane, best["lr"]), d / "jobs" / f"seeds-g{g}.yaml")
            log = d / "logs" / f"seeds-g{g}.log"
            if run_logged([*_satp(), "compare", str(job)], log, timings, f"seeds g{g}"):
                errors.append(f"G={g}: satp compare failed (see {log})")
        except Exception as exc:  # one size's failure leaves the others' results
            errors.append(f"G={g}: {type(exc).__name__}: {exc}")


# ----------------------------------------------------------------------------- entry point
def run() -> str:
    cfg = settings()
    cfg["dir"].mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()
    started = time.perf_counter()
    timings: dict[str, float] = {}
    errors: list[str] = []
    if not cfg["report_only"]:
        prepare(cfg, timings)
        threads = [threading.Thread(target=run_lane, args=(cfg, i, sizes, timings, errors), daemon=True)
                   for i, sizes in enumerate(lanes_of(cfg["sizes"], cfg["lanes"]))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    wall = time.perf_counter() - started
    load1 = os.getloadavg()
    record = cfg["dir"] / "run.json"  # the measured run's timings and load, for a later report-only pass
    if not cfg["report_only"]:
        record.write_text(json.dumps({"timings": timings, "load0": load0, "load1": load1, "wall": wall,
                                      "errors": errors}, indent=1))
    elif record.exists():
        saved = json.loads(record.read_text())
        timings, load0, load1, wall = saved["timings"], saved["load0"], saved["load1"], saved["wall"]
        errors = saved.get("errors", []) + errors
    result = analyse(cfg)
    try:
        plot(result, cfg)
    except Exception as exc:
        errors.append(f"plots: {type(exc).__name__}: {exc}")
    text = section(result, cfg, timings, load0, load1, errors, wall)
    (cfg["dir"] / "section.md").write_text(text)
    summary = {str(r["G"]): {"lr": r["best"]["lr"] if r["best"] else None,
                             "curves": r.get("curves")} for r in result["rows"]}
    (cfg["dir"] / "curves.json").write_text(json.dumps(summary, indent=1))
    return text


def main() -> int:
    print(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
