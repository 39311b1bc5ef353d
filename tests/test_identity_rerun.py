"""A run trained on raw files that were rebuilt since is never taken for the same run.

The report: train a job, rebuild its dataset (``satp data pycode --force``: 524 functions became
31), run the job again: "finished already (epoch 1, same configuration): nothing to train", naming
the old model. The shards are named by the raw files' fingerprint now, and the rerun check takes
it before Ray starts: a finished run and a run with epochs left alike stop with one line naming the
source data as what differs, and the two ways on. One real training run (1 epoch, 1 worker, on the
session's Ray) on a few dozen functions.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from preprocessing.pycode import build_pycode
from tests.helpers import small_python_source

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _values(base: Path) -> dict:
    return {
        "name": "rebuilt",
        "data": {"name": "ogbg-code2", "root": str(base / "data"), "source": "pycode"},
        "transform": {"rwpe_steps": 0, "lap_pe_dim": 0, "k_hops": 0},
        "shards": {"root": str(base / "shards"), "graphs_per_shard": 256},
        "model": {"hidden_dim": 16, "num_layers": 1, "num_heads": 2, "k_hops": 1, "gnn_type": "gcn"},
        "train": {"task": "code2", "epochs": 1, "warmup_epochs": 0, "node_budget": 4096, "precision": "fp32",
                  "storage_path": str(base / "ray"), "run_name": "rebuilt"},
        "resources": {"num_workers": 1, "cpus_per_worker": 1},
        "mlflow": {"tracking_uri": f"sqlite:///{base / 'mlflow.db'}", "experiment": "rebuilt",
                   "registered_model": "sat-rebuilt", "log_system_metrics": False},
    }


@pytest.fixture(scope="module")
def trained(ray_cluster, tmp_path_factory):
    """A finished run on the functions of ``json``, ``csv`` and ``shlex``; then its raw files rebuilt from
    ``json``'s modules alone (``satp data pycode --source <stdlib>/json --force``)."""
    from pipeline.config import JobConfig
    from pipeline.train.driver import train_job

    base = tmp_path_factory.mktemp("rebuilt")
    build_pycode(base / "data", [str(small_python_source(base / "src-1", ("json", "csv.py", "shlex.py")))])
    values = _values(base)
    outcome = train_job(JobConfig.model_validate(values))
    assert outcome.trained
    build_pycode(base / "data", [str(small_python_source(base / "src-2", ("json",)) / "json")], force=True)
    job = base / "job.yaml"
    job.write_text(yaml.safe_dump(values))
    return base, job


@pytest.mark.parametrize("epochs", [1, 2], ids=["finished", "epochs left"])
def test_rebuilt_raw_data_is_named_before_anything_starts(trained, capsys, epochs):
    from mlflow.tracking import MlflowClient

    from pipeline.cli import main

    base, job = trained
    shards_before = sorted(p.name for p in (base / "shards").iterdir())
    assert main(["train", str(job), "--set", f"train.epochs={epochs}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("satp: error: run 'rebuilt'"), err
    assert "the source data (fingerprint of the raw files)" in err[0]
    assert "--set train.run_name=rebuilt-2" in err[0] and "--restart" in err[0]
    assert sorted(p.name for p in (base / "shards").iterdir()) == shards_before  # the new data were not preprocessed
    client = MlflowClient(f"sqlite:///{base / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("rebuilt").experiment_id])
    assert run.info.status == "FINISHED"  # no attempt was opened
    assert len(client.search_model_versions("name='sat-rebuilt'")) == 1
