"""``satp compare`` end to end on the session's local Ray (2 CPUs), MLflow on SQLite: 2 variants x 2 seeds
of a tiny PATTERN job (1 epoch each), one Tune grid, one MLflow parent run with a child run per trial,
per-variant mean and standard deviation, a table and a plot logged; two trials at a time, the last two
in the first two's processes. Also what the driver does before
the trials: a variant's pre-flight error names the variant, and the models it builds to count their
parameters leave no generated PyG module in the temporary directory."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import parent_and_children, pattern_job_dict

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def comparison(ray_cluster, tmp_path_factory):
    from pipeline.sweep.compare import run_compare
    from pipeline.config import JobConfig
    from preprocessing.sbm import build_sbm

    tmp = tmp_path_factory.mktemp("compare")
    build_sbm(tmp / "data", "pattern", graphs=140, seed=0)  # 100 / 20 / 20 graphs
    raw = pattern_job_dict(tmp / "data", tmp, epochs=1)
    raw["model"].update(hidden_dim=16, num_layers=1)
    raw["resources"] = {"num_workers": 1, "cpus_per_worker": 0.5}
    raw["mlflow"]["experiment"] = "compare-tiny"
    # two trials at once: the last two run in the first two's processes (Tune's actor reuse)
    raw["compare"] = {"name": "cmp", "storage_path": str(tmp / "tune"), "seeds": [0, 1], "max_concurrent_trials": 2,
                      "variants": {"gcn": {"model.architecture": "gnn", "model.pe": "none", "model.pe_dim": 0},
                                   "sat": {}}}
    job = JobConfig.model_validate(raw)
    return {"outcome": run_compare(job, verbose=0), "uri": job.mlflow.tracking_uri, "tune": tmp / "tune" / "cmp",
            "job": job}


@pytest.mark.ray
@pytest.mark.slow
def test_every_variant_trains_with_every_seed(comparison):
    out = comparison["outcome"]
    assert not out.interrupted and out.metric == "acc" and out.epochs == 1
    assert sorted((t.variant, t.seed, t.status) for t in out.trials) == [
        ("gcn", 0, "finished"), ("gcn", 1, "finished"), ("sat", 0, "finished"), ("sat", 1, "finished")]
    for v in out.variants:
        assert v.seeds == [0, 1] and len(v.test) == 2 and all(0.0 <= x <= 1.0 for x in v.test)
        mean, std = v.test_mean_std
        assert mean == pytest.approx(sum(v.test) / 2)
        assert std == pytest.approx(abs(v.test[0] - v.test[1]) / math.sqrt(2))
        assert v.parameters and v.parameters > 0
    gcn, sat = out.variants
    assert gcn.parameters < sat.parameters  # no attention, no FFN
    from pipeline.sweep.compare import format_table

    table = format_table(out)
    assert "| gcn |" in table and "| sat | (the job) |" in table and "4 trials, 1 epoch each" in table


@pytest.mark.ray
@pytest.mark.slow
def test_the_last_two_trials_ran_in_the_first_two_trials_processes(comparison):
    """Tune's results name the process of every trial (``pid``): two, for four trials."""
    pids = {trial.name: {json.loads(line)["pid"] for line in (trial / "result.json").read_text().splitlines()}
            for trial in comparison["tune"].iterdir() if (trial / "result.json").is_file()}
    assert len(pids) == 4 and all(len(p) == 1 for p in pids.values()), pids
    assert len(set.union(*pids.values())) == 2, pids


@pytest.mark.ray
@pytest.mark.slow
def test_mlflow_holds_one_parent_and_a_child_per_trial(comparison):
    out = comparison["outcome"]
    client, parent, children = parent_and_children(comparison["uri"], "compare-tiny", "compare", out.parent_run_id)
    for v in out.variants:
        assert parent.data.metrics[f"{v.name}.test_acc_mean"] == pytest.approx(v.test_mean_std[0])
        assert parent.data.metrics[f"{v.name}.test_acc_std"] == pytest.approx(v.test_mean_std[1])
    assert sorted(r.data.tags["mlflow.runName"] for r in children) == ["gcn-seed0", "gcn-seed1", "sat-seed0", "sat-seed1"]
    for child in children:
        variant = child.data.tags["satp.variant"]
        assert child.data.params["model.architecture"] == ("gnn" if variant == "gcn" else "sat")
        assert child.data.params["train.seed"] in ("0", "1") and child.data.params["train.epochs"] == "1"
        assert [m.step for m in client.get_metric_history(child.info.run_id, "val_acc")] == [0]
        assert child.info.status == "FINISHED"
    artifacts = {a.path for a in client.list_artifacts(out.parent_run_id)}
    assert {"compare.md", "trials.json", "plots"} <= artifacts
    assert [a.path for a in client.list_artifacts(out.parent_run_id, "plots")] == ["plots/compare.png"]


def test_a_variants_preflight_error_names_the_variant(tmp_path, capsys):
    """The report's command: a variant the job's shards cannot feed fails before Ray, naming it."""
    from pipeline.cli import main

    raw = yaml.safe_load((ROOT / "jobs" / "code2-compare-local.yaml").read_text())
    raw["data"]["root"] = str(tmp_path / "data")
    raw["shards"]["root"] = str(tmp_path / "shards")
    raw["mlflow"]["tracking_uri"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    raw["compare"]["storage_path"] = str(tmp_path / "tune")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(raw))
    assert main(["compare", str(job), "--set", "compare.variants.sub2={model.extractor: subgraph}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("satp: error: compare.variants.sub2: model.extractor: 'subgraph'"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]  # no data, shards, comparison or MLflow store


@pytest.mark.ray
def test_the_driver_leaves_no_generated_pyg_module(ray_cluster, tmp_path):
    """``satp compare`` builds each variant's model in its driver to count the parameters; PyG renders
    the convolutions' ``propagate`` from a template into ``$TMPDIR`` the first time a process builds
    them. The driver's part in a fresh process whose ``TMPDIR`` is empty: nothing is left there."""
    from preprocessing import preprocess
    from tests.helpers import small_python_source

    from pipeline.config import JobConfig

    raw = yaml.safe_load((ROOT / "jobs" / "code2-compare-local.yaml").read_text())
    raw["data"].update(root=str(tmp_path / "data"), source_dirs=[str(small_python_source(tmp_path / "src", ("json",)) / "json")])
    raw["shards"]["root"] = str(tmp_path / "shards")
    job = JobConfig.model_validate(raw)
    shards = preprocess(job.data, job.transform, job.shards, progress=False)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    code = ("from pipeline.sweep.compare import count_parameters, variant_jobs; from pipeline.config import load_job; "
            f"jobs = variant_jobs(load_job({str(tmp_path / 'job.yaml')!r})); "
            f"print([count_parameters(jobs[v], {str(shards)!r}) for v in ('gcn', 'subtree_gcn')])")
    env = dict(os.environ, TMPDIR=str(tmp))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    counts = yaml.safe_load(out.stdout.strip().splitlines()[-1])
    assert all(c and c > 0 for c in counts)  # the models (GCN convolutions with edge features) were built
    assert list(tmp.iterdir()) == [], [p.name for p in tmp.iterdir()]


@pytest.mark.ray
@pytest.mark.slow
def test_a_rerun_of_another_job_is_refused_and_restart_starts_it_over(comparison):
    """The comparison records the job it ran: another job is one line naming what differs, before
    anything starts; ``restart`` trains every trial again in new MLflow runs, the old ones kept."""
    from mlflow.tracking import MlflowClient

    from pipeline.sweep.compare import run_compare

    client = MlflowClient(comparison["uri"])
    experiment = client.get_experiment_by_name("compare-tiny").experiment_id
    before = {r.info.run_id for r in client.search_runs([experiment])}
    changed = comparison["job"].model_copy(deep=True)
    changed.train.weight_decay = 0.5
    with pytest.raises(ValueError) as refused:
        run_compare(changed, verbose=0)
    line = str(refused.value)
    assert line.startswith(f"comparison 'cmp' ({comparison['tune']}) holds a comparison of another job "
                           "(train.weight_decay 1e-06 -> 0.5); it is not resumed with this job: pick a new "
                           "compare.name (--set compare.name=cmp-2), or pass --restart"), line
    assert {r.info.run_id for r in client.search_runs([experiment])} == before

    changed.compare.seeds = [0]  # one seed of each variant: a restart trains every trial of the job it is given
    again = run_compare(changed, verbose=0, restart=True)
    assert not again.resumed and sorted(t.status for t in again.trials) == ["finished"] * 2
    children = [r for r in client.search_runs([experiment]) if r.data.tags.get("mlflow.parentRunId") == again.parent_run_id]
    assert len(children) == 2 and {c.data.params["train.weight_decay"] for c in children} == {"0.5"}
    old = client.get_run(comparison["outcome"].parent_run_id)
    assert old.data.tags["satp.retired"] == "comparison started over (--restart)"
    assert before <= {r.info.run_id for r in client.search_runs([experiment])}  # the old runs stay
