"""The tune: section and the sweep's pure pieces (no Ray): validation, variants, promotion, the plot."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _job(space, **tune):
    from pipeline.config import JobConfig

    return JobConfig.model_validate({
        "name": "j",
        "data": {"name": "ogbg-code2", "source": "pycode"},
        "model": {"hidden_dim": 16, "num_heads": 2},
        "train": {"task": "code2"},
        "tune": {"space": space, **tune},
    })


def test_sweep_jobs_validate():
    from pipeline.config import load_job
    from pipeline.sweep.space import data_variants, space_jobs

    for name in ("code2-sweep.yaml", "code2-sweep-local.yaml"):
        job = load_job(ROOT / "jobs" / name)
        assert job.tune is not None and job.tune.num_samples >= 4
        space_jobs(job)
        assert data_variants(job) == [{}]


@pytest.mark.parametrize("space, match", [
    ({"train.lr": {"loguniform": [1e-3, 1e-4]}}, "low < high"),
    ({"train.lr": {"normal": [0, 1]}}, "normal"),
    ({"train.lr": {"choice": [1e-3], "uniform": [0, 1]}}, "exactly one"),
    ({"transform.rwpe_steps": {"randint": [4, 16]}}, "preprocessing need choice"),
    ({"mlflow.experiment": {"choice": ["a", "b"]}}, "cannot be swept"),
    ({"train.lr": {"choice": []}}, "non-empty"),
    ({}, "at least one"),
])
def test_bad_tune_sections_are_rejected(space, match):
    with pytest.raises(ValueError, match=match):
        _job(space)


def test_bad_keys_and_values_name_the_key():
    from pipeline.config import load_job
    from pipeline.sweep.space import space_jobs

    with pytest.raises(ValueError, match=r"tune\.space\.model\.dropout = 1\.5"):
        space_jobs(_job({"model.dropout": {"choice": [0.1, 1.5]}}))
    with pytest.raises(ValueError, match=r"tune\.space\.model\.no_such_key"):
        space_jobs(_job({"model.no_such_key": {"choice": [1, 2]}}))
    with pytest.raises(ValueError, match=r"tune\.space\.model\.gnn_type = 'gat'"):
        space_jobs(_job({"model.gnn_type": {"choice": ["gcn", "gat"]}}))
    with pytest.raises(ValueError, match=r"tune.*unknown key"):
        load_job(ROOT / "jobs" / "code2-sweep-local.yaml", ["tune.asha.patience=3"])


def test_linked_keys_and_data_variants():
    from pipeline.sweep.space import apply_config, base_job_dict, data_variants, space_jobs

    job = _job({"transform.rwpe_steps, model.pe_dim": {"choice": [4, 8]}, "model.pe": {"value": "rwpe"},
                "train.lr": {"loguniform": [1e-4, 1e-3]}})
    space_jobs(job)
    assert data_variants(job) == [{"transform.rwpe_steps, model.pe_dim": 4}, {"transform.rwpe_steps, model.pe_dim": 8}]
    raw = apply_config(base_job_dict(job), {"transform.rwpe_steps, model.pe_dim": 8, "train.lr": 3e-4})
    assert raw["transform"]["rwpe_steps"] == 8 and raw["model"]["pe_dim"] == 8 and raw["train"]["lr"] == 3e-4
    with pytest.raises(ValueError, match="appears twice"):
        _job({"train.lr": {"choice": [1]}, "model.dropout, train.lr": {"choice": [0.1]}})


def test_concurrency_is_capped_by_resources():
    from pipeline.sweep.runner import concurrency_cap
    from pipeline.sweep.space import space_jobs

    job = _job({"train.lr": {"choice": [1e-3]}})
    job.resources.num_workers, job.resources.cpus_per_worker = 1, 1
    assert concurrency_cap(space_jobs(job), job.tune.trial_cpus, {"CPU": 2.0}) == 2
    job.resources.cpus_per_worker = 0.5
    assert concurrency_cap(space_jobs(job), job.tune.trial_cpus, {"CPU": 2.0}) == 4
    job.resources.use_gpu, job.resources.num_workers = True, 2
    assert concurrency_cap(space_jobs(job), job.tune.trial_cpus, {"CPU": 64.0, "GPU": 8.0}) == 4
    assert concurrency_cap(space_jobs(job), 0, {"CPU": 64.0}) == 1  # nothing fits: one at a time (autoscaler)
    job = _job({"resources.num_workers": {"choice": [1, 4]}})
    assert concurrency_cap(space_jobs(job), job.tune.trial_cpus, {"CPU": 8.0}) == 2
    jobs = [job.model_copy(update={"resources": job.resources.model_copy(update={"num_workers": n})}) for n in (1, 2)]
    assert concurrency_cap(jobs, 1.0, {"CPU": 9.0}) == 3  # a comparison: its largest variant, and the trial's CPU


class FakeVersion:
    def __init__(self, version, tags):
        self.version, self.tags = str(version), dict(tags)


class FakeClient:
    """The four MlflowClient calls :func:`pipeline.registry.versions.promote` makes."""

    def __init__(self, versions, alias=None):
        self.versions = {int(v.version): v for v in versions}
        self.alias = alias

    def get_model_version_by_alias(self, name, alias):
        from mlflow.exceptions import MlflowException

        if self.alias is None:
            raise MlflowException("alias not found")
        return self.versions[self.alias]

    def set_registered_model_alias(self, name, alias, version):
        self.alias = int(version)

    def set_model_version_tag(self, name, version, key, value):
        self.versions[int(version)].tags[key] = value


def test_champion_moves_only_to_a_better_version():
    from pipeline.registry.versions import promote

    client = FakeClient([FakeVersion(1, {"metric.best_val_f1": "0.30"}), FakeVersion(2, {}), FakeVersion(3, {})])
    first = promote(client, "m", 1, 0.30, "best_val_f1", "max", "champion", "sweep a")
    assert first["champion"] and client.alias == 1
    worse = promote(client, "m", 2, 0.25, "best_val_f1", "max", "champion", "sweep b")
    assert not worse["champion"] and client.alias == 1
    assert "does not beat" in client.versions[2].tags["satp.champion_decision"]
    assert "satp.replaced_by" not in client.versions[1].tags
    better = promote(client, "m", 3, 0.35, "best_val_f1", "max", "champion", "sweep c")
    assert better["champion"] and client.alias == 3
    assert client.versions[1].tags["satp.replaced_by"] == "3"
    assert "0.35 > 0.3" in client.versions[1].tags["satp.replaced_reason"]
    assert "sweep c" in client.versions[1].tags["satp.replaced_reason"]
    # min mode (e.g. an MAE): lower wins
    client = FakeClient([FakeVersion(1, {"metric.best_val_mae": "0.2"}), FakeVersion(2, {})], alias=1)
    assert promote(client, "m", 2, 0.1, "best_val_mae", "min", "champion", "s")["champion"]


def test_plot_marks_early_stops(tmp_path):
    from pipeline.sweep.summary import TrialSummary, plot_sweep

    trials = [
        TrialSummary("a", {}, "finished", 3, 0.3, 0.3, 0.2, {"val": [(0, 0.1), (1, 0.2), (2, 0.3)]}, None),
        TrialSummary("b", {}, "early_stopped", 1, 0.05, 0.05, 0.04, {"val": [(0, 0.05)]}, None),
    ]
    plot_sweep(trials, "val_f1", tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_cli_rejects_a_job_without_tune_section(capsys):
    from pipeline.cli import main

    assert main(["tune", str(ROOT / "jobs" / "code2-local.yaml")]) == 2
    assert "no tune: section" in capsys.readouterr().err


def _record(job):
    from pipeline.sweep.record import recorded_job
    from pipeline.sweep.space import base_job_dict

    return recorded_job(base_job_dict(job), "tune", job.tune.model_dump(mode="json"))


def test_a_sweep_folder_resumes_only_the_job_it_recorded(tmp_path):
    """What a rerun of a sweep folder may do (:mod:`pipeline.sweep.record`), on files alone: the same job
    resumes; another job, or a folder that ran a sweep and records no job, is one line naming what differs
    and the ways on; nothing ran there yet, or ``--restart``, starts."""
    from pipeline.sweep.record import RECORD_FILE, check_rerun, start

    sweep = tmp_path / "tune" / "s"
    job = _job({"train.lr": {"grid": [1e-3, 1e-4]}}, name="s", storage_path=str(tmp_path / "tune"))
    ran = _record(job)
    assert "name" not in ran["tune"] and "storage_path" not in ran["tune"] and "run_name" not in ran["train"]
    check = dict(what="sweep", name="s", key="tune.name")
    check_rerun(sweep, ran, restart=False, **check)  # no folder yet
    sweep.mkdir(parents=True)
    (sweep / "satp-lease.json").write_text("{}")
    check_rerun(sweep, ran, restart=False, **check)  # only the lease of the command starting it

    (sweep / "experiment_state.json").write_text("{}")  # a sweep of an earlier satp: no record
    with pytest.raises(ValueError, match=r"holds a sweep that records no job .*--restart"):
        check_rerun(sweep, ran, restart=False, **check)

    start(sweep, ran, restart=False)
    assert sorted(p.name for p in sweep.iterdir()) == ["experiment_state.json", "satp-lease.json", RECORD_FILE]
    same = _job({"train.lr": {"grid": [1e-3, 1e-4]}}, name="s")  # the folder's own keys do not count
    check_rerun(sweep, _record(same), restart=False, **check)
    other = _job({"train.lr": {"grid": [1e-3, 1e-4]}}, name="s", asha={"reduction_factor": 3})
    other.train.weight_decay = 0.5
    with pytest.raises(ValueError) as refused:
        check_rerun(sweep, _record(other), restart=False, **check)
    line = str(refused.value)
    assert "\n" not in line and line.startswith(
        f"sweep 's' ({sweep}) holds a sweep of another job (train.weight_decay 1e-06 -> 0.5; "
        "tune.asha.reduction_factor 2.0 -> 3.0); it is not resumed with this job: pick a new tune.name "
        "(--set tune.name=s-2), or pass --restart to start it over"), line

    check_rerun(sweep, _record(other), restart=True, **check)
    start(sweep, _record(other), restart=True)  # emptied but for the lease, the new record whole
    assert sorted(p.name for p in sweep.iterdir()) == ["satp-lease.json", RECORD_FILE]
    check_rerun(sweep, _record(other), restart=False, **check)

