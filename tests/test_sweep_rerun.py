"""Sweeps behave like runs on a rerun: one sweep, one job.

What a user trial found: a killed ``satp tune`` rerun with one changed setting
(``--set train.weight_decay=0.5``) failed the trials that had finished (each one's Train run refused
the other configuration), trained the unstarted ones with 0.5 under MLflow params of 1e-06, and
registered the best of them; a finished sweep rerun with changed settings
(``tune.asha.reduction_factor=3``) returned the old result in seconds, without a word. And the
summary of a successful sweep was followed by Ray's lines: a worker's late epoch line, gRPC's goodbye.

Now the sweep records the job it ran in its folder, and a rerun of another job is refused before
Ray starts, in one line naming what differs and the ways on (a new ``tune.name``, ``--restart``);
the same job resumes, every finished trial stays finished and every trial's MLflow params are what
trained it; ``--restart`` starts the sweep over in new MLflow runs (the old runs and registered
versions stay). Real ``satp tune`` commands against the session's Ray cluster, MLflow on SQLite, a
real SIGKILL; two trials of one Train worker, one at a time, two epochs each.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import Drain, satp_env, satp_lines, tiny_job_dict, tracebacks, wait_until

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
NAME = "r"
#: a line of satp tune's summary after its first (pipeline.sweep.tune.format_outcome)
SUMMARY_LINE = re.compile(r"^(  \S+ +(finished|early_stopped) +epochs |best trial |registered models:/|MLflow parent run )")


def _sweep_job(base: Path, where: Path) -> Path:
    values = tiny_job_dict(base, run_name="r", storage_path=str(where / "ray"), epochs=2, train_subset=300,
                           eval_subset=100)
    values["resources"] |= {"num_workers": 1, "cpus_per_worker": 1}
    values["mlflow"] |= {"tracking_uri": f"sqlite:///{where / 'mlflow.db'}", "experiment": "rerun",
                         "registered_model": "sat-r"}
    values["tune"] = {"name": NAME, "storage_path": str(where / "tune"), "num_samples": 1, "metric": "val_f1",
                      "mode": "max", "max_concurrent_trials": 1,
                      "asha": {"grace_period": 1, "reduction_factor": 2, "max_epochs": 2},
                      "space": {"train.lr": {"grid": [3e-3, 1e-3]}}}
    path = where / "sweep.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def _tune(job: Path, address: str, *more: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", "tune", str(job), "--no-progress", "--address", address, *more]


def _run(job: Path, address: str, *more: str) -> subprocess.CompletedProcess:
    """``satp tune``, its standard output and error in one stream, in the order written."""
    return subprocess.run(_tune(job, address, *more), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600, env=satp_env(PYTHONUNBUFFERED="1"), cwd=ROOT)


def _ends_with_the_summary(output: str) -> list[str]:
    """The summary's lines, asserted to be the last of ``output`` (nothing of Ray's after them)."""
    lines = output.rstrip("\n").splitlines()
    first = max(i for i, line in enumerate(lines) if line.startswith(f"sweep {NAME}"))
    summary = lines[first:]
    assert all(SUMMARY_LINE.match(line) for line in summary[1:]), "\n".join(lines[-30:])
    assert summary[-1].startswith("MLflow parent run "), "\n".join(lines[-30:])
    return summary


def _children(uri: str, parent_run_id: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("rerun").experiment_id])
    return [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent_run_id]


def _parent_id(summary: list[str]) -> str:
    return summary[-1].split()[3]


def _trained_weight_decays(sweep_dir: Path) -> set[float]:
    """``train.weight_decay`` of every trial's checkpoints, as their Train runs recorded what trained them."""
    states = list((sweep_dir / "train").glob("*/checkpoint_*/state.json"))
    assert states, f"no checkpoint under {sweep_dir / 'train'}"
    return {json.loads(p.read_text())["provenance"]["config"]["train"]["weight_decay"] for p in states}


@pytest.fixture(scope="module")
def killed_sweep(tiny_setting, tmp_path_factory):
    """A sweep killed (SIGKILL) while its second trial trains, its first finished; then rerun with
    ``train.weight_decay=0.5``, then with the job it ran."""
    base, address = tiny_setting
    where = tmp_path_factory.mktemp("rerun")
    job = _sweep_job(base, where)
    sweep_dir = where / "tune" / NAME
    first = subprocess.Popen(_tune(job, address), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env=satp_env(), cwd=ROOT, start_new_session=True)
    drained = Drain(first)
    try:
        # the second trial's Train run has started (one trial at a time: the first has finished)
        wait_until(lambda: len([p for p in (sweep_dir / "train").glob("*") if p.is_dir()]) == 2, "the second trial",
                  timeout=500, proc=first)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        drained.finish(timeout=60)
    started = time.monotonic()
    changed = _run(job, address, "--set", "train.weight_decay=0.5")
    changed_took = time.monotonic() - started
    resumed = _run(job, address)
    return {"job": job, "address": address, "where": where, "sweep_dir": sweep_dir, "changed": changed,
            "changed_took": changed_took, "resumed": resumed, "uri": f"sqlite:///{where / 'mlflow.db'}"}


def test_a_killed_sweep_rerun_with_another_setting_is_refused_before_ray(killed_sweep):
    changed = killed_sweep["changed"]
    out = changed.stdout
    assert changed.returncode == 2, out[-3000:]
    [line] = satp_lines(out, "error")
    assert line.startswith(f"satp: error: sweep '{NAME}' ({killed_sweep['sweep_dir']}) holds a sweep of another job "
                           "(train.weight_decay 1e-06 -> 0.5); it is not resumed with this job: pick a new tune.name "
                           f"(--set tune.name={NAME}-2), or pass --restart to start it over"), line
    assert "connecting to the Ray cluster" not in out and not tracebacks(out), out[-3000:]
    print(f"the changed rerun was refused in {killed_sweep['changed_took']:.1f} s")


def test_the_same_job_resumes_with_no_failed_trial_and_params_of_what_trained(killed_sweep):
    resumed = killed_sweep["resumed"]
    out = resumed.stdout
    assert resumed.returncode == 0, out[-3000:]
    assert not tracebacks(out), out[-3000:]
    summary = _ends_with_the_summary(out)
    assert summary[0].startswith(f"sweep {NAME} (resumed): 2 trials"), summary
    assert len([line for line in summary if line.startswith("  ")]) == 2, summary  # finished or stopped early
    children = _children(killed_sweep["uri"], _parent_id(summary))
    assert len(children) == 2 and all(c.info.status in ("FINISHED", "KILLED") for c in children), \
        [(c.data.tags.get("satp.trial_id"), c.info.status) for c in children]
    assert {c.data.params["train.weight_decay"] for c in children} == {"1e-06"}
    assert _trained_weight_decays(killed_sweep["sweep_dir"]) == {1e-06}
    record = json.loads((killed_sweep["sweep_dir"] / "satp-sweep.json").read_text())
    assert record["train"]["weight_decay"] == 1e-06 and record["tune"]["asha"]["reduction_factor"] == 2


def test_a_finished_sweep_rerun_with_another_setting_is_refused_and_restart_starts_it_over(killed_sweep):
    from mlflow.tracking import MlflowClient

    job, address, sweep_dir = killed_sweep["job"], killed_sweep["address"], killed_sweep["sweep_dir"]
    old_parent = _parent_id(_ends_with_the_summary(killed_sweep["resumed"].stdout))
    changed = _run(job, address, "--set", "tune.asha.reduction_factor=3")
    assert changed.returncode == 2, changed.stdout[-3000:]
    [line] = satp_lines(changed.stdout, "error")
    assert "holds a sweep of another job (tune.asha.reduction_factor 2.0 -> 3.0)" in line, line

    restarted = _run(job, address, "--restart", "--set", "train.weight_decay=0.5")
    out = restarted.stdout
    assert restarted.returncode == 0, out[-3000:]
    assert not tracebacks(out), out[-3000:]
    summary = _ends_with_the_summary(out)
    assert summary[0].startswith(f"sweep {NAME}: 2 trials"), summary  # not resumed: started over
    new_parent = _parent_id(summary)
    assert new_parent != old_parent
    assert {c.data.params["train.weight_decay"] for c in _children(killed_sweep["uri"], new_parent)} == {"0.5"}
    assert _trained_weight_decays(sweep_dir) == {0.5}  # the old Train runs were deleted with the folder
    client = MlflowClient(killed_sweep["uri"])
    old = client.get_run(old_parent)
    assert old.data.tags["satp.retired"] == "sweep started over (--restart)"
    assert old.data.params["train.weight_decay"] == "1e-06"  # the old runs stay, as they were
    assert len(_children(killed_sweep["uri"], old_parent)) == 2
    assert len(client.search_model_versions("name='sat-r'")) == 2  # the old sweep's version stays
