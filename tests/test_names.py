"""Names that become paths or MLflow names, checked in the pre-flight.

``--set train.run_name=../escape`` wrote a run's checkpoints and lease outside
``train.storage_path``, and ``--set mlflow.registered_model=../evil/m`` trained for minutes before
MLflow refused the name at registration. Both are now one ``satp: error:`` line naming the key,
status 2, before Ray starts or anything is written; ``x/y`` still nests inside its folder. The
rules for MLflow names are written out (no MLflow import in the pre-flight), so they are held here
against MLflow's own validators.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.config.names import experiment_problem, path_name_problem, registered_model_problem

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "jobs" / "code2-local.yaml"
SWEEP = ROOT / "jobs" / "code2-sweep-local.yaml"
NAMES = ["sat-code2", "m", "a/b", "../evil/m", "..", ".", "x/../y", "a:b", "", "  ", "x/", "/abs", "a.b", "a b",
         "..x", "x..", "é", "a" * 600, "./x", "a//b"]


@pytest.mark.parametrize("name", NAMES)
def test_the_mlflow_rules_are_mlflows_own(name):
    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import _validate_experiment_name, _validate_model_name

    for ours, theirs in ((registered_model_problem, _validate_model_name), (experiment_problem, _validate_experiment_name)):
        try:
            theirs(name)
            refused = False
        except MlflowException:
            refused = True
        assert (ours(name) is not None) == refused, (ours.__name__, name)


@pytest.mark.parametrize("name, inside", [("run", True), ("x/y", True), ("a.b-c_d", True), ("../escape", False),
                                          ("x/../../y", False), ("/tmp/x", False), ("x/../y", False), ("x/", False),
                                          ("./x", False), ("", False), ("..", False)])
def test_a_path_name_stays_inside_its_folder(name, inside):
    assert (path_name_problem(name) is None) == inside, path_name_problem(name)


@pytest.mark.parametrize("command, job, key, value", [
    ("train", JOB, "train.run_name", "../escape"),
    ("train", JOB, "train.run_name", "/tmp/elsewhere"),
    ("train", JOB, "name", "../up"),
    ("train", JOB, "mlflow.registered_model", "../evil/m"),
    ("train", JOB, "mlflow.registered_model", "a:b"),
    ("tune", SWEEP, "tune.name", "../sweep"),
])
def test_a_bad_name_is_one_line_in_the_preflight(command, job, key, value, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SATP_RUNS_DIR", str(tmp_path / "runs"))
    started = time.monotonic()
    assert main([command, str(job), "--set", f"{key}={value}", "--set", f"train.storage_path={tmp_path / 'ray'}"]) == 2
    took = time.monotonic() - started
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"satp: error: {key}"), err
    assert repr(value) in err[0], err
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())  # nothing written, inside or outside
    assert took < 30, took  # the pre-flight, not a run: Ray never started


def test_a_python_caller_is_refused_before_the_lease_is_written(tmp_path):
    """``train_job`` (sweeps' trials, the demo) resolves its plan, and the names, before it writes the lease."""
    from pipeline.config import load_job
    from pipeline.train.plan import JobPlan, run_dir

    job = load_job(JOB, [f"train.storage_path={tmp_path / 'ray'}", "train.run_name=../escape"])
    with pytest.raises(ValueError, match=r"^train.run_name: '../escape': it leads out of the storage path"):
        JobPlan.resolve(job)
    nested = JobPlan.resolve(load_job(JOB, [f"train.storage_path={tmp_path / 'ray'}", "train.run_name=x/y"]))
    assert run_dir(nested.job) == tmp_path / "ray" / "x" / "y"
    assert not any(tmp_path.iterdir())
