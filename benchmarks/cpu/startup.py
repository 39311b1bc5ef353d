"""Start-up benchmark (``BENCH=startup make bench``): seconds from ``satp train`` to its first step,
cold (a local Ray started by the command), warm (a second command on a running ``satp cluster``), and
per trial of an 8-trial ``satp tune`` sweep; with the phases of the run's own start-up line
(:mod:`pipeline.train.startup`).

The job is ``jobs/pattern-local.yaml`` (its data and MLflow store made beforehand, not timed), one
epoch, 2 CPU workers; the sweep samples ``train.lr`` over 8 trials of 1 epoch, one at a time. Every command runs
in its own process; no other benchmark runs meanwhile.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "jobs" / "pattern-local.yaml"
TRIALS = 8
LINE = re.compile(r"start-up ([0-9.]+) s to the first step: (.*)")


def _job_file(base: Path) -> Path:
    """pattern-local with every path under ``base``, 1 epoch, and a tune section of 8 lr trials."""
    import yaml

    raw = yaml.safe_load(JOB.read_text())
    raw["data"]["root"] = str(base / "data")
    raw["shards"]["root"] = str(base / "shards")
    raw["train"].update(epochs=1, storage_path=str(base / "ray"), eval_every=1)
    raw["mlflow"].update(tracking_uri=f"sqlite:///{base / 'mlflow.db'}", registered_model="sat-startup-bench")
    raw["tune"] = {"name": "startup-sweep", "num_samples": TRIALS, "metric": "val_acc", "mode": "max",
                   "max_concurrent_trials": 1, "seed": 0,
                   "storage_path": str(base / "tune"),
                   "asha": {"grace_period": 1, "reduction_factor": 2, "max_epochs": 1},
                   "space": {"train.lr": {"loguniform": [1e-4, 1e-2]}}}
    path = base / "startup.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _satp(args: list[str], env: dict) -> tuple[float, str]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1800)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"satp {' '.join(args)} failed ({proc.returncode}): {out[-1500:]}")
    return time.monotonic() - started, out


def _startups(output: str) -> list[tuple[float, str]]:
    return [(float(m.group(1)), m.group(2).strip()) for m in LINE.finditer(output)]


def _env(home: Path) -> dict:
    env = dict(os.environ, SATP_HOME=str(home), DS_ACCELERATOR="cpu", OUTDATED_IGNORE="1", TQDM_DISABLE="1")
    env.pop("RAY_ADDRESS", None)
    return env


def _train(job: Path, name: str, env: dict) -> tuple[float, float, str]:
    """(to the first step, the command's wall time, phases) of one 1-epoch ``satp train``."""
    wall, out = _satp(["train", str(job), "--no-progress", "--no-register", "--restart",
                       "--set", f"train.run_name={name}"], env)
    found = _startups(out)
    if not found:
        raise RuntimeError(f"no start-up line in satp train's output: {out[-1500:]}")
    return found[-1][0], wall, found[-1][1]


def _sweep(job: Path, env: dict) -> tuple[float, list[float]]:
    wall, out = _satp(["tune", str(job), "--no-progress"], env)
    return wall, [seconds for seconds, _ in _startups(out)]


def run() -> str:
    rows: list[str] = []
    with tempfile.TemporaryDirectory(prefix="satp-startup-") as tmp:
        base = Path(tmp)
        job = _job_file(base)
        cold_home, warm_home = base / "no-cluster", base / "home"
        cold_home.mkdir()
        _satp(["preprocess", str(job), "--no-progress"], _env(cold_home))  # data and shards: not timed
        import mlflow  # the SQLite store's tables, made once per store (~4 s): not timed

        mlflow.MlflowClient(f"sqlite:///{base / 'mlflow.db'}").search_experiments()
        try:
            seconds, wall, phases = _train(job, "cold", _env(cold_home))
            rows.append(f"| cold (no satp cluster) | {seconds:.1f} | {wall:.1f} | {os.getloadavg()[0]:.1f} | "
                        f"{phases} |")
            started = time.monotonic()
            _satp(["cluster", "start", "--no-dashboard"], _env(warm_home))
            cluster_s = time.monotonic() - started
            for i in (1, 2):
                seconds, wall, phases = _train(job, f"warm{i}", _env(warm_home))
                rows.append(f"| warm, command {i} on the satp cluster | {seconds:.1f} | {wall:.1f} | "
                            f"{os.getloadavg()[0]:.1f} | {phases} |")
            sweep_wall, trials = _sweep(job, _env(warm_home))
        finally:
            _satp(["cluster", "stop"], _env(warm_home))
    later = sorted(trials[1:])
    sweep = (f"`satp tune` of {TRIALS} one-epoch trials on the satp cluster: {sweep_wall:.0f} s in all; trial start-up "
             f"(to its first step) {trials[0]:.1f} s for the first, then median {later[len(later) // 2]:.1f} s, "
             f"max {later[-1]:.1f} s (all: {', '.join(f'{t:.1f}' for t in trials)})")
    shutil.rmtree(base, ignore_errors=True)
    return "\n".join([
        "### Start-up: `satp train` to its first step (`BENCH=startup`)",
        f"Command: `satp train {JOB.relative_to(ROOT)} --set train.epochs=1` (data and MLflow store present, "
        f"2 CPU workers); the satp cluster started in {cluster_s:.0f} s (`satp cluster start`, until its fork "
        "server answered); load: the machine's 1-minute load average after the command.",
        "",
        "| path | to first step (s) | command wall (s) | load | phases |",
        "|---|---|---|---|---|",
        *rows,
        "",
        sweep,
    ])


if __name__ == "__main__":
    print(run())
