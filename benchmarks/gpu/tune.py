"""GPU check, part ``tune`` (``benchmarks/gpu/run.sh tune``): the sweep path on CUDA, once.

``satp tune`` of ``jobs/code2-sweep.yaml`` made small (:func:`sweep_job`: ``satp data pycode`` over the
standard library): four one-worker trials sharing the GPU (0.25 each, at most three at once), 3 epochs,
a learning-rate grid whose last value (1e-6) starts once the first three passed ASHA's rung at epoch 1
with far lower training losses, so ASHA stops it there (ranked by ``train_loss``: validation F1 after one
epoch of a small split ties at 0). Reported: the command's wall time, each trial from MLflow, the card's
peak memory and most processes; checked: four trials, none failed; the 1e-6 one stopped after epoch 1;
each stopped at a rung or trained 3 epochs, one of them 3; the champion alias on the best trial's run;
trials on the card together. ``SATP_GPU_DRY_RUN=1``: CPU workers, a tiny model, 150 graphs per split.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import yaml

from benchmarks.gpu.measure import (DRY_RUN, ROOT, Clock, check_lines, copy_logs, device, measure, out_dir, pycode_data, satp,
                                    step_lines)

BUDGET_S = float(os.environ.get("SATP_GPU_BUDGET_S") or 480)
GRAPHS_PER_SPLIT = int(os.environ.get("SATP_TUNE_GRAPHS") or (150 if DRY_RUN else 1500))
WORK_DIR = Path(os.environ.get("SATP_TUNE_DIR") or ROOT / "runs" / ("gpu-tune-dry" if DRY_RUN else "gpu-tune"))
JOB = "jobs/code2-sweep.yaml"
LRS = [1e-3, 5e-4, 2e-4, 1e-6]  # the last one far behind: ASHA's to stop
EPOCHS = 3


def sweep_job(name: str) -> dict:
    """``jobs/code2-sweep.yaml`` made small: this part's data, trials, grid and stores."""
    job = yaml.safe_load((ROOT / JOB).read_text())
    job["data"] |= {"root": str(WORK_DIR / "data"), "source": "pycode", "max_graphs_per_split": GRAPHS_PER_SPLIT}
    job["shards"]["root"] = str(WORK_DIR / "shards")
    job["train"] |= {"epochs": EPOCHS, "warmup_epochs": 0, "node_budget": 16384, "eval_node_budget": 32768}
    job["resources"] = {"num_workers": 1, "use_gpu": True, "gpus_per_worker": 0.25, "cpus_per_worker": 3}
    job["mlflow"] |= {"tracking_uri": f"sqlite:///{WORK_DIR / 'mlflow.db'}", "registered_model": "sat-gpu-tune"}
    job["tune"] = {"name": name, "storage_path": str(WORK_DIR / "tune"), "num_samples": 1, "metric": "train_loss",
                   "mode": "min", "max_concurrent_trials": 3, "trial_cpus": 1, "max_failures": 0,
                   "asha": {"grace_period": 1, "reduction_factor": 2, "max_epochs": EPOCHS},
                   "space": {"train.lr": {"grid": LRS}}}
    if DRY_RUN:
        job["model"] |= {"hidden_dim": 32, "num_layers": 1}
        job["train"] |= {"node_budget": 2048, "eval_node_budget": 4096, "loader_workers": 0}
        job["resources"] = {"num_workers": 1, "use_gpu": False, "cpus_per_worker": 0.5}
        job["tune"]["trial_cpus"] = 0
    return job


def trial_rows(tracking_uri: str, parent_run_id: str) -> list[dict]:
    """Each trial's MLflow run under the sweep's parent: its settings, status and figures."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    rows = []
    for run in client.search_runs(experiments, filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'"):
        history = {key: [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]
                   for key in ("train_loss", "val_f1", "graphs_per_s")}
        ended = run.info.end_time or run.info.start_time
        rows.append({"trial_id": run.data.tags.get("satp.trial_id"), "run_id": run.info.run_id,
                     "lr": float(run.data.params.get("train.lr", "nan")), "status": run.info.status,
                     "early_stopped": run.data.tags.get("satp.early_stopped") == "true",
                     "epochs": len(history["train_loss"]), "seconds": (ended - run.info.start_time) / 1000,
                     "best_train_loss": min(history["train_loss"], default=None),
                     "best_val_f1": max(history["val_f1"], default=None),
                     "last_graphs_per_s": (history["graphs_per_s"] or [None])[-1]})
    return sorted(rows, key=lambda r: -r["lr"])


def _champion(tracking_uri: str, name: str):
    from mlflow.tracking import MlflowClient

    try:
        return MlflowClient(tracking_uri).get_model_version_by_alias(name, "champion")
    except Exception:
        return None


def _parent_run_id(stdout: str) -> str | None:
    for line in stdout.splitlines():
        if line.startswith("MLflow parent run "):
            return line.split()[3]
    return None


def run() -> str:
    clock = Clock(BUDGET_S)
    out = out_dir()
    logs = WORK_DIR / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    name = f"gpu-tune-{time.strftime('%Y%m%d-%H%M%S')}"
    job = sweep_job(name)
    job_file = WORK_DIR / f"{name}.yaml"
    job_file.write_text(yaml.safe_dump(job, sort_keys=False))
    raw: dict = {"name": name, "job": job, "steps": {}}
    steps = raw["steps"]

    def save() -> None:
        if out is not None:
            (out / "gpu_tune.json").write_text(json.dumps(raw, indent=1, default=str))

    lines = ["### GPU check, part tune (`benchmarks/gpu/run.sh tune`)", "",
             f"Device: {device()}; budget {BUDGET_S:.0f} s. `satp tune` of `{JOB}` made "
             f"small (`{job_file.relative_to(ROOT) if job_file.is_relative_to(ROOT) else job_file}`): "
             f"{GRAPHS_PER_SPLIT} graphs per split of `satp data pycode`, {len(LRS)} trials (train.lr {LRS}), at most "
             f"{job['tune']['max_concurrent_trials']} at once, 1 worker each "
             f"({job['resources'].get('gpus_per_worker', 0)} GPU, {job['resources']['cpus_per_worker']} CPUs), "
             f"{EPOCHS} epochs, ASHA from epoch 1 on train_loss.", ""]
    print(f"== gpu tune: {name} ({clock.left():.0f} s left)", flush=True)

    steps["pycode"] = pycode_data(WORK_DIR, clock.left() * 0.3, logs)
    save()
    if steps["pycode"]["ok"]:
        print(f"   satp tune ({clock.left():.0f} s left)", flush=True)
        # the command's whole time: preprocessing (its shards), the sweep, the registration
        steps["tune"] = measure(satp("tune", str(job_file), "--no-progress"), clock.left() - 20, logs / "tune.log",
                                grace_s=15)
        save()

    lines += step_lines(steps)

    checks: list[tuple[str, bool, str]] = []
    tuned = steps.get("tune", {})
    parent = _parent_run_id(tuned.get("stdout_tail", ""))
    if parent is not None:
        uri = job["mlflow"]["tracking_uri"]
        trials = raw["trials"] = trial_rows(uri, parent)
        lines += ["", "| train.lr | trial | MLflow status | epochs | best train loss | best val F1 | graphs/s, last epoch "
                      "| run s |", "|---|---|---|---|---|---|---|---|"]
        for t in trials:
            lines.append(f"| {t['lr']:g} | {t['trial_id']} | {t['status']}{' (ASHA)' if t['early_stopped'] else ''} | "
                         f"{t['epochs']} | {_num(t['best_train_loss'], '.4f')} | {_num(t['best_val_f1'], '.4f')} | "
                         f"{_num(t['last_graphs_per_s'], ',.0f')} | {t['seconds']:.0f} |")
        by_lr = {t["lr"]: t for t in trials}
        checks.append((f"{len(LRS)} trials, none failed", len(trials) == len(LRS) and all(t["status"] != "FAILED" for t in trials),
                       ", ".join(f"{t['lr']:g}: {t['status']}" for t in trials)))
        slow = by_lr.get(LRS[-1])
        checks.append((f"lr {LRS[-1]:g} stopped by ASHA after epoch 1", bool(slow and slow["early_stopped"] and slow["epochs"] == 1),
                       f"{slow['epochs']} epoch(s), early_stopped {slow['early_stopped']}" if slow else "no such trial"))
        # ASHA's rungs lie at epochs 1 and 2 (grace period 1, reduction factor 2): a trial ends at one of
        # them or trains every epoch, and the best one trains every epoch
        rungs = {1, 2}
        checks.append((f"every trial stopped at a rung ({sorted(rungs)}) or trained {EPOCHS} epochs; one trained {EPOCHS}",
                       all(t["epochs"] in rungs if t["early_stopped"] else t["epochs"] == EPOCHS for t in trials)
                       and any(t["epochs"] == EPOCHS for t in trials),
                       ", ".join(f"{t['lr']:g}: {t['epochs']}" for t in trials)))
        champion = _champion(uri, job["mlflow"]["registered_model"])
        best = min((t for t in trials if t["best_train_loss"] is not None), key=lambda t: t["best_train_loss"], default=None)
        checks.append(("the champion alias on the best trial's run", bool(champion and best and champion.run_id == best["run_id"]),
                       f"version {getattr(champion, 'version', '-')}, run {getattr(champion, 'run_id', '-')}; best trial "
                       f"{best['trial_id'] if best else '-'}"))
    else:
        checks.append(("the sweep's outcome printed (its MLflow parent run)", False, tuned.get("tail", "not run")[:300]))
    if tuned.get("gpu_processes") is not None:
        checks.append(("trials on the card together (most processes on it at once >= 2)", tuned["gpu_processes"] >= 2,
                       f"{tuned['gpu_processes']} processes; peak memory {tuned.get('gpu_mem_gb') or 0:.2f} GB"))
    raw["checks"] = [{"check": c, "ok": ok, "detail": d} for c, ok, d in checks]
    lines += check_lines(checks, f"the sweep's command {tuned.get('seconds', 0):.0f} s; part wall time "
                                 f"{BUDGET_S - clock.left():.0f} s")
    copy_logs(logs, out, "tune")
    save()
    return "\n".join(lines)


def _num(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


if __name__ == "__main__":
    print(run())
