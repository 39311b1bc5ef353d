"""What several test modules share: the tiny jobs and datasets they train on, tiny registered models,
the ``satp`` commands they run and how they read their output, waiting with a deadline, and a few
model and data tools. Fixtures shared by several modules are in ``conftest.py``."""
from __future__ import annotations

import dataclasses
import gzip
import json
import os
import shutil
import socket
import subprocess
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import torch
import yaml

from runtime import fork_server

ROOT = Path(__file__).resolve().parents[1]
#: what names the session's Ray cluster to a command (tests/conftest.py's ``ray_cluster``): dropped by a
#: test whose command must find no cluster, or a satp cluster of its own
SESSION_CLUSTER_VARS = ("RAY_ADDRESS", fork_server.SOCKET_VAR)


# ----------------------------------------------------------------------------- processes and waiting
def process_state(pid: int) -> str:
    """Process ``pid``'s state letter from ``/proc`` (``R``, ``S``, ``T`` stopped, ``Z`` zombie, ...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def is_running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (exited, waiting for its parent to reap it)."""
    try:
        state = process_state(pid)
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


#: the addresses a socket bound to loopback has (IPv4, IPv4 on an IPv6 socket, IPv6)
LOOPBACK_IPS = ("127.0.0.1", "::ffff:127.0.0.1", "::1")


def listening_sockets(folder: str) -> list[tuple[str, str, int]]:
    """``(process name, address, port)`` of every TCP port the processes of the Ray cluster in ``folder``
    listen on (:func:`runtime.local_cluster.processes_of`)."""
    import psutil

    from runtime.local_cluster import processes_of

    found = []
    for proc in processes_of(folder):
        try:
            found += [(proc.name(), *c.laddr) for c in proc.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            continue
    return found


def wait_until(condition, what: str, timeout: float = 300, proc: subprocess.Popen | None = None,
               every: float = 0.05) -> None:
    """Poll ``condition()`` every ``every`` s; fail naming ``what`` when ``timeout`` passes or ``proc``
    ends first (a condition that scans processes polls less often: each look costs CPU)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the command ended (status {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:.0f} s")
        time.sleep(every)


def run_one_rank(argv: list[str], env: dict, timeout: float, **kwargs):
    """``subprocess.run`` of a one-process torch.distributed job on a free ``MASTER_PORT``, again on
    another one where the port was taken between the look and the job's bind (``EADDRINUSE``: the
    session's Ray processes and commands open ports all the while)."""
    for _attempt in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.run(argv, env={**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                              capture_output=True, text=True, timeout=timeout, **kwargs)
        if proc.returncode == 0 or "EADDRINUSE" not in proc.stderr:
            break
    return proc


# ----------------------------------------------------------------------------- satp commands
def satp_env(**extra) -> dict:
    """The environment of a ``satp`` command a test runs: no test fault unless ``extra`` names one."""
    return {**os.environ, "OUTDATED_IGNORE": "1", "DS_ACCELERATOR": "cpu", "RAY_USAGE_STATS_ENABLED": "0",
            "SATP_TEST_FAULT": "", **extra}


def satp_lines(stderr: str, kind: str = "") -> list[str]:
    """The ``satp:`` lines of a command's standard error (``kind``: ``error``, ``warning``, ...)."""
    return [line for line in stderr.splitlines() if line.startswith(f"satp: {kind}")]


def tracebacks(stderr: str) -> list[str]:
    """Tracebacks of the ``satp`` process itself (what the cluster's actors forward starts with
    ``(ActorName pid=...)``: e.g. Ray Train's placement-group cleaner on a machine where it finds
    several Ray instances, which says nothing about the command)."""
    return [line for line in stderr.splitlines() if line.startswith("Traceback")]


def checkpoint_epochs(run_dir: Path) -> dict[str, int]:
    """The epoch of each checkpoint folder of ``run_dir`` that has its ``state.json``."""
    return {p.name: json.loads((p / "state.json").read_text())["epoch"]
            for p in sorted(run_dir.glob("checkpoint_*")) if (p / "state.json").is_file()}


def checkpoint_part(where: Path, epoch: int, files: dict[str, bytes | Path] | None = None) -> Path:
    """A rank-0 part of a checkpoint as :func:`pipeline.train.checkpoint.save` leaves it in its local
    folder (real files, their sizes and digests listed last); a ``Path`` value is linked, not copied."""
    from preprocessing.shard_places import sha256_file

    files = {"state.json": json.dumps({"epoch": epoch, "world_size": 1}).encode(),
             "ds/last/mp_rank_00_model_states.pt": os.urandom(300_000), "best_model.pt": os.urandom(1000),
             **(files or {})}
    for name, data in files.items():
        (where / name).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, Path):
            (where / name).symlink_to(data)
        else:
            (where / name).write_bytes(data)
    listed = {name: {"size": len(data), "sha256": sha256_file(where / name)} for name, data in files.items()
              if not isinstance(data, Path)}
    listed |= {name: {"size": 1 << 40, "sha256": "0" * 64} for name, data in files.items() if isinstance(data, Path)}
    (where / "rank_0.json").write_text(json.dumps({"files": listed}))
    return where


class Drain:
    """A process's standard error, read as it comes (so that a long run never blocks on a full pipe)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.parts = proc, []
        self.thread = threading.Thread(target=lambda: self.parts.extend(iter(proc.stderr.readline, "")), daemon=True)
        self.thread.start()

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def finish(self, timeout: float = 600) -> str:
        self.proc.wait(timeout=timeout)
        self.thread.join(timeout=30)
        return self.text


# ----------------------------------------------------------------------------- the tiny jobs
#: the tiny code2 dataset's sources: the functions of a few standard-library packages
SOURCES = [str(Path(sysconfig.get_paths()["stdlib"]) / d) for d in ("asyncio", "multiprocessing", "email")]


def tiny_job_dict(base: Path, **train) -> dict:
    """A job on ~1,600 graphs that a 2-worker CPU run learns in a few epochs."""
    return {
        "name": "tiny",
        "data": {"name": "ogbg-code2", "root": str(base / "data"), "source": "pycode", "source_dirs": SOURCES},
        "transform": {"rwpe_steps": 0, "lap_pe_dim": 0, "k_hops": 0, "vocab_size": 5000},
        "shards": {"root": str(base / "shards"), "graphs_per_shard": 512},
        "model": {"hidden_dim": 32, "num_layers": 1, "num_heads": 4, "dropout": 0.0, "k_hops": 1, "gnn_type": "gcn"},
        "train": {"task": "code2", "epochs": 3, "warmup_epochs": 0.5, "lr": 3e-3, "node_budget": 1024,
                  "eval_node_budget": 4096, "storage_path": str(base / "ray"), "run_name": "tiny", **train},
        "resources": {"num_workers": 2, "cpus_per_worker": 1},
        "mlflow": {"tracking_uri": f"sqlite:///{base / 'mlflow.db'}", "experiment": "tiny",
                   "registered_model": "sat-tiny", "log_system_metrics": False},
    }


def tiny_job(base: Path, **train):
    """The tiny job as a validated ``JobConfig``."""
    from pipeline.config import JobConfig

    return JobConfig.model_validate(tiny_job_dict(base, **train))


def tiny_data(base: Path):
    """Build (or reuse) the tiny dataset's shards under ``base``; return their directory."""
    from preprocessing import preprocess

    job = tiny_job(base)
    return preprocess(job.data, job.transform, job.shards, progress=False)


def load_source(data):
    """The dataset's columnar store (a ``DataConfig``), building its raw folder and converting it where
    needed, as ``satp preprocess`` does."""
    from preprocessing.columnar import raw_fingerprint
    from preprocessing.conversion import build_store
    from preprocessing.sources import ensure_dataset

    folder = ensure_dataset(data)
    return build_store(folder, data.name, raw_fingerprint(folder, data.name))


def write_job(path: Path, values: dict) -> Path:
    path.write_text(yaml.safe_dump(values))
    return path


def train_command(job: Path, address: str | None, *more: str) -> list[str]:
    """``satp train JOB --no-progress`` as a test runs it (``--address`` when given)."""
    import sys

    return [sys.executable, "-m", "pipeline.cli", "train", str(job), "--no-progress", *more,
            *(["--address", address] if address else [])]


def run_satp_train(job: Path, address: str | None, *more: str, timeout: float = 600, **env) -> subprocess.CompletedProcess:
    return subprocess.run(train_command(job, address, *more), capture_output=True, text=True, timeout=timeout,
                          env=satp_env(**env), cwd=ROOT)


def fault_job(base: Path, where: Path, run_name: str, storage: Path | None = None, workers: int = 1, **train) -> Path:
    """A tiny job on 300 training graphs, its runs and MLflow store in ``where``."""
    train = {"train_subset": 300, "eval_subset": 100, **train}
    values = tiny_job_dict(base, run_name=run_name, storage_path=str(storage or where / "ray"), **train)
    values["resources"]["num_workers"] = workers
    values["mlflow"] |= {"tracking_uri": f"sqlite:///{where / 'mlflow.db'}", "registered_model": f"sat-{run_name}"}
    return write_job(where / f"{run_name}.yaml", values)


def tiny_subset_job(base: Path, tmp_path: Path, run_name: str, **train) -> Path:
    """The tiny job, 2 workers, on a subset of its graphs (epochs of a few steps: what is asserted is
    the interrupt's handling, not learning), written to ``tmp_path``."""
    train = {"train_subset": 300, "eval_subset": 100, **train}
    values = tiny_job_dict(base, run_name=run_name, storage_path=str(tmp_path / "ray"), **train)
    values["mlflow"]["tracking_uri"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    path = tmp_path / f"{run_name}.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def pattern_job_dict(root: Path, base: Path, **train) -> dict:
    """A job on the tiny regenerated PATTERN under ``root`` that one worker learns in 3 epochs."""
    return {
        "name": "pattern-tiny",
        "data": {"name": "pattern", "root": str(root), "source": "sbm"},
        "transform": {"rwpe_steps": 7, "lap_pe_dim": 0, "k_hops": 0},
        "shards": {"root": str(base / "shards"), "graphs_per_shard": 200},
        "model": {"hidden_dim": 32, "num_layers": 2, "num_heads": 4, "dropout": 0.0, "attention": "dense",
                  "extractor": "subtree", "k_hops": 1, "gnn_type": "gcn", "use_edge_attr": False,
                  "pe": "rwpe", "pe_dim": 7},
        "train": {"task": "pattern", "epochs": 3, "warmup_epochs": 0, "scheduler": "constant", "lr": 3e-3,
                  "node_budget": 3200, "max_graphs_per_batch": 16, "precision": "fp32", "grad_clip": 0.0,
                  "storage_path": str(base / "ray"), "run_name": "pattern-tiny", **train},
        "resources": {"num_workers": 1, "cpus_per_worker": 1},
        "mlflow": {"tracking_uri": f"sqlite:///{base / 'mlflow.db'}", "experiment": "pattern-tiny",
                   "registered_model": "sat-pattern-tiny", "log_system_metrics": False},
    }


def parent_and_children(tracking_uri: str, experiment: str, kind: str, parent_run_id: str):
    """The one FINISHED parent run of a sweep or comparison (``satp.kind``) and its child runs."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    parents = [r for r in runs if r.data.tags.get("satp.kind") == kind]
    assert len(parents) == 1 and parents[0].info.run_id == parent_run_id
    assert parents[0].info.status == "FINISHED"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent_run_id]
    return client, parents[0], children


# ----------------------------------------------------------------------------- tiny registered models
NODE_TYPES = ["Module", "FunctionDef", "arguments", "arg", "Return", "Name", "Load", "Attribute", "Constant",
              "BinOp", "Add", "Assign", "Store", "Call", "Expr", "__UNK__"]
ATTRS = ["_mask_", "self", "x", "__UNK__", "__NONE__"]
PATTERN_GRAPHS = [{"num_nodes": 4, "edge_index": [[0, 1, 2], [1, 2, 3]], "x": [0, 1, 2, 0]},
                  {"num_nodes": 3, "edge_index": [[0, 1], [1, 2]], "x": [2, 2, 1]}]
#: a Python file whose functions the model of :func:`log_tiny_model` names
PREDICT_SOURCE = '''
def get_name(self):
    return self.name


class Box:
    def setValue(self, x):
        self.value = x + 1

    async def fetch_all_items(self):
        return [i for i in self.items]
'''


@dataclasses.dataclass
class Tiny:
    model: torch.nn.Module
    task: object
    config: object
    vocab: list | None
    extra: dict
    sample: object


def tiny_model(task_name: str, seed: int = 0) -> Tiny:
    """An untrained SAT of hidden size 8 for ``code2`` or ``pattern``, with what registering it needs."""
    from pipeline.tasks import make_task
    from preprocessing.config import TransformConfig
    from sat import SAT
    from sat.config import SATConfig
    from sat.data import SATData

    torch.manual_seed(seed)
    transform = TransformConfig(rwpe_steps=0, k_hops=0).model_dump(mode="json")
    if task_name == "code2":
        vocab = ["get", "name", "set", "value", "__UNK__", "__EOS__"]
        task = make_task("code2", vocab=vocab, max_seq_len=5)
        sample = SATData(x=torch.tensor([[0, 1], [3, 2], [5, 1]]), edge_index=torch.tensor([[0, 1], [1, 2]]),
                         edge_attr=torch.tensor([[0, 0], [1, 1]]), node_depth=torch.tensor([0, 1, 2]))
        extra = {"input": {"task": "code2", "transform": transform, "node_types": NODE_TYPES, "node_attributes": ATTRS}}
    else:
        vocab = None
        task = make_task("pattern")
        sample = SATData(x=torch.tensor([[0], [1], [2]]), edge_index=torch.tensor([[0, 1, 1, 2], [1, 0, 2, 1]]))
        extra = {"input": {"task": "pattern", "transform": transform}}
    config = task.configure(SATConfig(hidden_dim=8, num_layers=1, num_heads=2, k_hops=1, dropout=0.0), sample)
    return Tiny(SAT(config).eval(), task, config, vocab, extra, sample)


def sqlite_store(tmp_path: Path) -> tuple[str, str]:
    """``(tracking URI, experiment id)`` of a SQLite MLflow store in ``tmp_path`` (experiment ``t``)."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("t")
    exp_id = exp.experiment_id if exp else client.create_experiment("t", artifact_location=(tmp_path / "art").as_uri())
    return uri, exp_id


def new_run(uri: str, exp_id: str) -> str:
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri).create_run(exp_id).info.run_id


def register_tiny(tiny: Tiny, uri: str, run_id: str, name: str) -> dict:
    """``tiny`` logged to run ``run_id`` and registered as ``name``, as satp registers a trained model."""
    from pipeline.registry.versions import log_and_register

    return log_and_register(tiny.model, task=tiny.task, model_config=tiny.config, vocab=tiny.vocab, run_id=run_id,
                            tracking_uri=uri, registered_model=name, data_manifest_hash="abc",
                            metrics={"best_val_acc": 0.5}, extra=tiny.extra,
                            provenance={"config_hash": "cfg1", "git_commits": ["c0ffee"]})


def register_format1(tiny: Tiny, uri: str, run_id: str, name: str) -> int:
    """A version as satp logged them before format 2: the pickled module (mlflow.pytorch) and
    ``extra_files/satp_model.json``."""
    import mlflow
    import mlflow.pytorch

    meta = {"format": 1, "task": tiny.task.state(), "model_config": dataclasses.asdict(tiny.config),
            "vocab": tiny.vocab, "data_manifest_hash": "abc", "git_commit": "c0ffee",
            "metrics": {"best_val_acc": 0.5}, "provenance": {"config_hash": "cfg1", "git_commits": ["c0ffee"]},
            **tiny.extra}
    mlflow.set_tracking_uri(uri)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "satp_model.json"
        path.write_text(json.dumps(meta))
        with mlflow.start_run(run_id=run_id):
            info = mlflow.pytorch.log_model(tiny.model, name="model", serialization_format="pickle",
                                            extra_files=[str(path)], pip_requirements=["torch"])
    tags = {"data_manifest_hash": "abc", "git_commit": "c0ffee", "task": tiny.task.name, "run_id": run_id,
            "satp.config_hash": "cfg1", "metric.best_val_acc": "0.5",
            "satp.champion_decision": "promoted to champion: no champion yet"}
    return int(mlflow.register_model(info.model_uri, name, tags=tags).version)


def register_as_before(uri: str, run_id: str, name: str, seed: int, val: float, files_digests: bool = True) -> int:
    """A version as satp registered them before the logged model's record: the same two files (no
    ``model_id``), the weights' sha256, the files' digests (``files_digests``: registered after they
    were recorded) and the identity as tags, a logged model without parameters."""
    import mlflow

    from pipeline.registry.model_format import FORMAT, PYFUNC_CODE, cpu_state, weights_sha256, write_files
    from pipeline.registry.record import files_tag
    from pipeline.registry.versions import PIP_REQUIREMENTS

    tiny = tiny_model("pattern", seed=seed)
    state = cpu_state(tiny.model)
    sha = weights_sha256(state)
    meta = {"format": FORMAT, "weights_sha256": sha, "task": tiny.task.state(),
            "model_config": dataclasses.asdict(tiny.config), "vocab": None, "data_manifest_hash": "abc",
            "git_commit": "c0ffee", "metrics": {"best_val_acc": val}, "run_id": run_id, **tiny.extra}
    mlflow.set_tracking_uri(uri)
    with tempfile.TemporaryDirectory() as tmp:
        code = Path(tmp) / "satp_pyfunc.py"
        code.write_text(PYFUNC_CODE)
        artifacts = write_files(state, meta, Path(tmp))
        digests = files_tag({Path(path).name: Path(path) for path in artifacts.values()})
        with mlflow.start_run(run_id=run_id):
            info = mlflow.pyfunc.log_model(name="model", python_model=str(code), artifacts=artifacts,
                                           pip_requirements=PIP_REQUIREMENTS)
    tags = {"data_manifest_hash": "abc", "git_commit": "c0ffee", "task": "pattern", "run_id": run_id,
            "metric.best_val_acc": f"{val:.6g}", "satp.weights_sha256": sha,
            **({"satp.files_sha256": digests} if files_digests else {})}
    return int(mlflow.register_model(info.model_uri, name, tags=tags).version)


def stored_files(uri: str, name: str, version: int) -> Path:
    """The folder the store keeps the version's model files in (not a downloaded copy)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    model_id = client.get_model_version(name, str(version)).source.removeprefix("models:/")
    return Path(client.get_logged_model(model_id).artifact_location.removeprefix("file://"))


def log_tiny_model(tmp_path, name: str, task_name: str) -> str:
    """A SQLite store in ``tmp_path`` with an untrained ``code2`` or ``ppa`` model registered as
    ``name`` in a finished run; returns its tracking URI."""
    from mlflow.tracking import MlflowClient

    from pipeline.registry.versions import log_and_register
    from pipeline.tasks import make_task
    from preprocessing.config import TransformConfig
    from sat import SAT
    from sat.config import SATConfig
    from sat.data import SATData

    uri, exp_id = sqlite_store(tmp_path)
    client = MlflowClient(uri)
    run_id = client.create_run(exp_id).info.run_id
    torch.manual_seed(0)
    if task_name == "code2":
        vocab = ["get", "name", "set", "value", "fetch", "all", "items", "__UNK__", "__EOS__"]
        task = make_task("code2", vocab=vocab, max_seq_len=5)
        sample = SATData(x=torch.zeros(3, 2, dtype=torch.long), edge_index=torch.tensor([[0, 1], [1, 2]]),
                         edge_attr=torch.tensor([[0, 0], [1, 1]]), node_depth=torch.zeros(3, dtype=torch.long))
        spec = {"input": {"task": "code2", "transform": TransformConfig(rwpe_steps=0, k_hops=0).model_dump(mode="json"),
                          "node_types": NODE_TYPES, "node_attributes": ATTRS}}
    else:
        vocab = None
        task = make_task("ppa", num_classes=37)
        sample = SATData(x=torch.zeros(3, 1, dtype=torch.long), edge_index=torch.tensor([[0, 1], [1, 2]]),
                         edge_attr=torch.rand(2, 7))
        spec = {"input": {"task": "ppa", "transform": TransformConfig(rwpe_steps=0, k_hops=0).model_dump(mode="json")}}
    config = task.configure(SATConfig(hidden_dim=8, num_layers=1, num_heads=2, k_hops=1, dropout=0.0), sample)
    model = SAT(config).eval()
    log_and_register(model, task=task, model_config=config, vocab=vocab, run_id=run_id, tracking_uri=uri,
                     registered_model=name, data_manifest_hash="abc", metrics={"best_val_x": 0.5}, extra=spec)
    client.set_terminated(run_id)
    return uri


# ----------------------------------------------------------------------------- data and model tools
#: A few standard-library modules: ~255 functions in 6 top-level modules (json is a package).
SMALL_MODULES = ("json", "csv.py", "textwrap.py", "shlex.py", "fractions.py", "argparse.py")


def small_python_source(dest: str | Path, modules: tuple[str, ...] = SMALL_MODULES) -> Path:
    """Copy a few standard-library modules into ``dest`` (a source dir for ``satp data pycode``)."""
    from preprocessing.source_files import default_source_dirs

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    stdlib = default_source_dirs()[0]
    for name in modules:
        src = stdlib / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "tests", "test"),
                            dirs_exist_ok=True)
        else:
            shutil.copy2(src, dest / name)
    return dest


def copy_dataset(root: Path, tmp: Path, name: str) -> Path:
    """A copy of dataset ``name``'s raw files under ``tmp/root`` (without what was built from them)."""
    dst = tmp / "root"
    shutil.copytree(root / name, dst / name, ignore=shutil.ignore_patterns("processed", "columnar"))
    return dst


def rewrite_gz(path: Path, edit) -> None:
    """Replace the lines of the gzipped text file ``path`` by ``edit(lines)``."""
    with gzip.open(path, "rt") as fh:
        lines = fh.read().splitlines()
    lines = edit(lines)
    with gzip.open(path, "wt") as fh:
        fh.write("\n".join(lines) + ("\n" if lines else ""))


def conversion_killed_in(dataset: str, key: str, batch_rows: int = 0) -> str:
    """Code for ``python -c CODE FOLDER``: build FOLDER's columnar store of ``dataset`` in 4 KiB blocks
    (``batch_rows``: rows per record batch, 0 keeps the default), SIGKILLed in the third block of
    the raw file converted into the store's ``key`` (a conversion interrupted mid-file)."""
    rows = f"conversion.BATCH_ROWS = {batch_rows}" if batch_rows else ""
    return f"""
import os, signal, sys
from preprocessing import columnar, conversion
conversion.BLOCK_BYTES = 1 << 12
{rows}
parse, blocks = conversion._parse, []

def dies_mid_file(block, spec, path):
    if spec.key == {key!r}:
        blocks.append(1)
        if len(blocks) == 3:
            os.kill(os.getpid(), signal.SIGKILL)
    return parse(block, spec, path)

conversion._parse = dies_mid_file
folder = sys.argv[1]
conversion.build_store(folder, {dataset!r}, columnar.raw_fingerprint(folder, {dataset!r}))
"""


def random_graph(n: int, gen: torch.Generator, with_subgraphs: bool = False):
    """A random ``n``-node graph with 2n edges, 3-dim edge attributes and a 4-dim RWPE."""
    from sat import SATData, add_subgraph_indices

    ei = torch.randint(0, n, (2, 2 * n), generator=gen)
    data = SATData(
        x=torch.randint(0, 6, (n, 1), generator=gen),
        edge_index=ei,
        edge_attr=torch.rand(2 * n, 3, generator=gen),
        rwpe=torch.rand(n, 4, generator=gen),
    )
    return add_subgraph_indices(data, 2) if with_subgraphs else data


def kept_for_backward(fn) -> list[torch.Tensor]:
    """The distinct tensors (one per storage and dtype) autograd keeps for the backward pass while ``fn`` runs."""
    seen = {}

    def pack(t):
        seen.setdefault((t.untyped_storage().data_ptr(), t.dtype), t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return list(seen.values())
