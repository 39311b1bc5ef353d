"""The registry on an object store: a tracking server started with ``mlflow server
--artifacts-destination s3://...`` (a real S3 API server, moto on loopback) keeps the registered
models' artifacts in the bucket; ``satp predict models:/NAME@ALIAS`` runs in a process that has only
the tracking server's address: another working directory and home, no store credentials, no file
of the registering process, its downloads through the server
(``MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD=false``: without it MLflow's client fetches files over the
server's presigned URLs, straight from the store, which moto's signature checks refuse)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from s3_server import s3_server  # noqa: F401  (the session's server, a fixture)
from tests.mlflow_servers import ROOT, start, stop
from tests.helpers import PREDICT_SOURCE as SOURCE

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(s3_server, tmp_path_factory):
    """The tracking server (SQLite for runs and the registry), its artifacts under an ``s3://`` prefix."""
    from pipeline.registry import empty_store

    tmp = tmp_path_factory.mktemp("store-registry")
    database = f"sqlite:///{tmp / 'mlflow.db'}"
    empty_store.seed(database)
    artifacts = s3_server.prefix("mlartifacts")
    # the server's boto3 reads the standard variables; MLflow also names the endpoint in its own variable
    proc, url = start(["server", "--backend-store-uri", database, "--artifacts-destination", artifacts,
                       "--workers", "1"], tmp / "server.log", {**s3_server.env(), "MLFLOW_S3_ENDPOINT_URL": s3_server.url})
    yield url, artifacts
    stop(proc)


def _register(url: str) -> None:
    """A tiny untrained code2 model, logged and registered through the server, with an alias."""
    import torch
    from mlflow.tracking import MlflowClient

    from pipeline.registry.versions import log_and_register
    from pipeline.tasks import make_task
    from preprocessing.config import TransformConfig
    from sat import SAT
    from sat.config import SATConfig
    from sat.data import SATData
    from tests.helpers import ATTRS, NODE_TYPES

    client = MlflowClient(url)
    experiment = client.create_experiment("store")  # artifact location: the server's (mlflow-artifacts:/)
    run_id = client.create_run(experiment).info.run_id
    torch.manual_seed(0)
    vocab = ["get", "name", "set", "value", "fetch", "all", "items", "__UNK__", "__EOS__"]
    task = make_task("code2", vocab=vocab, max_seq_len=5)
    sample = SATData(x=torch.zeros(3, 2, dtype=torch.long), edge_index=torch.tensor([[0, 1], [1, 2]]),
                     edge_attr=torch.tensor([[0, 0], [1, 1]]), node_depth=torch.zeros(3, dtype=torch.long))
    config = task.configure(SATConfig(hidden_dim=8, num_layers=1, num_heads=2, k_hops=1, dropout=0.0), sample)
    spec = {"input": {"task": "code2", "transform": TransformConfig(rwpe_steps=0, k_hops=0).model_dump(mode="json"),
                      "node_types": NODE_TYPES, "node_attributes": ATTRS}}
    log_and_register(SAT(config).eval(), task=task, model_config=config, vocab=vocab, run_id=run_id, tracking_uri=url,
                     registered_model="store-code2", data_manifest_hash="abc", metrics={"best_val_x": 0.5}, extra=spec)
    client.set_terminated(run_id)
    client.set_registered_model_alias("store-code2", "champion", "1")


def test_a_model_registered_through_the_server_lives_in_the_bucket_and_predicts_elsewhere(server, s3_server, tmp_path):
    url, artifacts = server
    _register(url)
    bucket, prefix = artifacts.removeprefix("s3://").split("/", 1)
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]
    assert any(k.endswith("/MLmodel") for k in keys), keys  # the model's files are objects of the bucket
    elsewhere = tmp_path / "another-node"
    elsewhere.mkdir()
    (elsewhere / "mymodule.py").write_text(SOURCE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MLFLOW_"))}  # no store credentials
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "predict", "models:/store-code2@champion", "mymodule.py",
                           "--json"], cwd=elsewhere, capture_output=True, text=True, timeout=300,
                          env={**env, "HOME": str(elsewhere), "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": url,
                                          "MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD": "false"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    predicted = json.loads(proc.stdout[proc.stdout.index("["):])
    assert [p["name"] for p in predicted] == ["get_name", "setValue", "fetch_all_items"]
    assert all(tok in ["get", "name", "set", "value", "fetch", "all", "items", "__UNK__"] for p in predicted
               for tok in p["predicted"])
