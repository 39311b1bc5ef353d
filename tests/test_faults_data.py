"""Faults at every data and registry write: each of {killed mid-write (SIGKILL), damaged
afterwards (truncated, bit-flipped), disk full (a real ENOSPC on a small tmpfs), a second writer at
the same time} against each write where it makes sense: the columnar raw store, the Arrow shards,
the registry's artifacts and model versions.

What every case asserts: the next command detects it and names the file in one ``satp:`` line,
converts / rebuilds only what was damaged (the intact files keep their inode and mtime), and ends
with what a clean build gives (the same graphs, the same shard bytes, a loadable version).
Faults are injected for real: a writer process kills itself with SIGKILL at a chosen point (its
function wrapped in the killed process only), files are cut or flipped on disk, the disk is a
tmpfs filled to the last pages (skipped where mounting is not permitted), and the second writer is
a second process. docs/faults.md has the table.
"""
from __future__ import annotations

import json
import os
import pickle
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from preprocessing import DataConfig, ShardConfig, TransformConfig, preprocess
from preprocessing.columnar import STORE_DIR, STORE_FILE, ColumnarStore, file_specs, raw_fingerprint
from preprocessing.conversion import build_store, convert_file
from preprocessing.pycode import build_pycode
from preprocessing.shards import MANIFEST, VOCAB_FILE
from tests.helpers import small_python_source
from tests.helpers import (PATTERN_GRAPHS, conversion_killed_in, new_run, register_tiny, sqlite_store, stored_files,
                           tiny_model)

ROOT = Path(__file__).resolve().parents[1]
NAME = "ogbg-code2"
TRANSFORM = TransformConfig(rwpe_steps=0, k_hops=0, vocab_size=300)


def _env() -> dict:
    """The environment of a writer process, taken when it starts: Ray's connection settings (its
    token) are set in this process's environment once the session's cluster runs."""
    return dict(os.environ, PYTHONPATH=str(ROOT))


# ----------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    """A small ogbg-code2 raw folder (three standard-library modules) and its store's graphs."""
    root = tmp_path_factory.mktemp("faults-raw")
    build_pycode(root, [small_python_source(root / "src", ("textwrap.py", "shlex.py", "csv.py"))], workers=1)
    folder = root / "ogbg_code2"
    store = build_store(folder, NAME, raw_fingerprint(folder, NAME))
    return folder, store.chunk(np.arange(store.num_graphs))


def _copy(raw, tmp_path: Path) -> Path:
    folder = tmp_path / "data" / "ogbg_code2"
    shutil.copytree(raw[0], folder, ignore=shutil.ignore_patterns(STORE_DIR))
    return folder


def _stamps(directory: Path, pattern: str) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(directory.glob(pattern))}


def _satp_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("satp:")]


def _converting(folder: Path) -> tuple[list[str], "ColumnarStore"]:
    """``build_store`` as ``satp preprocess`` calls it: which files it converted, and the store."""
    converted: list[str] = []

    def run(calls):
        for args in calls:
            converted.append(args[2].key)
            yield convert_file(*args)

    store = build_store(folder, NAME, raw_fingerprint(folder, NAME), run=run)
    return converted, store


def _same_graphs(store: ColumnarStore, reference: dict) -> None:
    chunk = store.chunk(np.arange(store.num_graphs))
    assert chunk.keys() == reference.keys()
    for key, value in reference.items():
        assert (chunk[key] == value) if key == "y_tokens" else np.array_equal(chunk[key], value), key


def _flip(path: Path, at: int | None = None) -> None:
    """Flip one bit of byte ``at`` (default: the middle one): the size stays, only a checksum sees it."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0x10
    path.write_bytes(bytes(data))


def _cut(path: Path) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size // 2)


def _script(code: str, *args, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], cwd=ROOT, env=_env(),
                            text=True, **popen)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _read_line_with(proc: subprocess.Popen, needle: str, timeout: float = 180) -> str:
    """The first stderr line of ``proc`` holding ``needle`` (the process may block right after it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stderr], [], [], 1.0)
        if ready:
            line = proc.stderr.readline()
            assert line, f"{proc.args}: ended without {needle!r}"
            if needle in line:
                return line.rstrip("\n")
    raise AssertionError(f"no {needle!r} within {timeout} s")


# ============================================================================= the columnar store
_KILLED_CONVERSION = conversion_killed_in("ogbg-code2", "x", batch_rows=512)  # node-feat spans blocks and batches


def test_store_killed_mid_write_converts_only_the_unfinished_files(raw, tmp_path, capfd):
    folder = _copy(raw, tmp_path)
    killed = _script(_KILLED_CONVERSION, folder)
    assert killed.wait(timeout=120) == -signal.SIGKILL
    store = folder / STORE_DIR
    assert not (store / STORE_FILE).exists() and (store / ".x.arrow.tmp-{}".format(killed.pid)).stat().st_size > 0
    kept = _stamps(store, "*.arrow")
    capfd.readouterr()
    converted, opened = _converting(folder)
    assert converted == ["x", "node_is_attributed", "node_dfs_order", "node_depth", "split-train", "split-valid",
                         "split-test"]
    assert _satp_lines(capfd.readouterr().err) == [
        f"satp: converting raw/node-feat.csv.gz again into {store / 'x.arrow'}: its conversion was interrupted "
        "(a temporary file was left)"]
    assert {k: v for k, v in _stamps(store, "*.arrow").items() if k in kept} == kept  # finished files untouched
    assert not list(store.glob(".*.tmp-*"))
    _same_graphs(opened, raw[1])


def _cut_store_file(store: Path) -> str:
    _cut(store / "x.arrow")
    return f"converting raw/node-feat.csv.gz again into {store / 'x.arrow'}: x.arrow has "


def _flip_store_file(store: Path) -> str:
    _flip(store / "edge_index.arrow")
    return (f"converting raw/edge.csv.gz again into {store / 'edge_index.arrow'}: edge_index.arrow's checksum "
            "differs from the one recorded (corrupt)")


def _garble_sidecar(store: Path) -> str:
    (store / "node_depth.arrow.json").write_text("{not json")
    return f"converting raw/node_depth.csv.gz again into {store / 'node_depth.arrow'}: its sidecar node_depth.arrow.json is unreadable"


def _cut_store_json(store: Path) -> str:
    _cut(store / STORE_FILE)
    return f"writing {store / STORE_FILE} again: it is unreadable"


STORE_DAMAGE = {"truncated file": (_cut_store_file, ["x"]), "bit-flipped file": (_flip_store_file, ["edge_index"]),
                "unreadable sidecar": (_garble_sidecar, ["node_depth"]), "truncated store.json": (_cut_store_json, [])}


@pytest.mark.parametrize("damage", list(STORE_DAMAGE))
def test_store_damaged_afterwards_converts_only_the_damaged_file(raw, tmp_path, capfd, damage):
    folder = _copy(raw, tmp_path)
    build_store(folder, NAME, raw_fingerprint(folder, NAME))
    store = folder / STORE_DIR
    harm, redone = STORE_DAMAGE[damage]
    before = _stamps(store, "*.arrow")
    said = harm(store)
    if damage == "truncated file":  # a shard task opening the store meanwhile names it (sizes, every open)
        with pytest.raises(ValueError, match=r"x\.arrow: damaged columnar store file \(\d+ bytes, \d+ recorded\)"):
            ColumnarStore(folder)
    capfd.readouterr()
    converted, opened = _converting(folder)
    assert converted == redone
    lines = _satp_lines(capfd.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith(f"satp: {said}"), lines
    after = _stamps(store, "*.arrow")
    assert {k: v for k, v in after.items() if k.removesuffix(".arrow") not in redone} == \
           {k: v for k, v in before.items() if k.removesuffix(".arrow") not in redone}
    assert json.loads((store / STORE_FILE).read_text())["files"]["x"]["bytes"] == (store / "x.arrow").stat().st_size
    _same_graphs(opened, raw[1])


def test_store_on_a_full_disk_names_the_file_and_resumes_once_there_is_room(raw, small_disk, capfd):
    disk = small_disk.mount("8m")  # what is written there beyond it fails with ENOSPC
    folder = disk / "data" / "ogbg_code2"
    shutil.copytree(raw[0], folder, ignore=shutil.ignore_patterns(STORE_DIR))
    store_bytes = sum(p.stat().st_size for p in (raw[0] / STORE_DIR).glob("*.arrow"))
    filler = small_disk.fill(leave=store_bytes // 3)
    with pytest.raises(OSError) as info:
        build_store(folder, NAME, raw_fingerprint(folder, NAME))
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(folder / STORE_DIR) + "/")
    assert "could not write it (No space left on device)" in message
    store = folder / STORE_DIR
    assert not (store / STORE_FILE).exists() and not list(store.glob(".*.tmp-*"))
    finished = _stamps(store, "*.arrow")
    filler.unlink()
    capfd.readouterr()
    converted, opened = _converting(folder)
    counts, others = file_specs(NAME)[:2], file_specs(NAME)[2:]
    assert {s.arrow for s in counts} <= set(finished) and len(finished) < len(file_specs(NAME))
    assert set(converted) == {s.key for s in others} - {k.removesuffix(".arrow") for k in finished}
    assert {k: v for k, v in _stamps(store, "*.arrow").items() if k in finished} == finished
    _same_graphs(opened, raw[1])


_SECOND_CONVERSION = """
    import json, sys, time
    from pathlib import Path
    from preprocessing import columnar, conversion
    folder, marker = sys.argv[1], Path(sys.argv[2])
    if sys.argv[3] == "first":  # holds the lock, paused in its first file until the test says go
        parse, once = conversion._parse, []

        def paused(block, spec, path):
            if not once:
                once.append(marker.touch())
                while marker.exists():
                    time.sleep(0.05)
            return parse(block, spec, path)

        conversion._parse = paused
    converted = []

    def run(calls):
        for args in calls:
            converted.append(args[2].key)
            yield conversion.convert_file(*args)

    conversion.build_store(folder, "ogbg-code2", columnar.raw_fingerprint(folder, "ogbg-code2"), run=run)
    print(json.dumps(converted))
"""


def test_store_second_writer_waits_and_converts_nothing(raw, tmp_path):
    folder = _copy(raw, tmp_path)
    marker = tmp_path / "paused"
    first = _script(_SECOND_CONVERSION, folder, marker, "first", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _wait_for(marker, first)
    second = _script(_SECOND_CONVERSION, folder, tmp_path / "unused", "second", stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE)
    line = _read_line_with(second, "waiting")
    assert line == (f"satp: the columnar store {folder / STORE_DIR} is being written by satp (pid {first.pid} on "
                    f"{os.uname().nodename}): waiting for it to finish")
    marker.unlink()  # the first writer goes on
    out1, err1 = first.communicate(timeout=120)
    out2, err2 = second.communicate(timeout=120)
    assert first.returncode == 0 and second.returncode == 0, err1 + err2
    assert len(json.loads(out1)) == len(file_specs(NAME)) - 2 and json.loads(out2) == []  # converted once
    _same_graphs(ColumnarStore(folder), raw[1])


# ============================================================================= the shards
def _configs(data_root: Path, shards_root: Path) -> tuple[DataConfig, ShardConfig]:
    return (DataConfig(name=NAME, root=str(data_root), source="pycode"),
            ShardConfig(root=str(shards_root), graphs_per_shard=8))


@pytest.fixture(scope="module")
def shards(raw, ray_cluster, tmp_path_factory):
    """The reference shard directory of ``raw`` (its store converted already) and its bytes."""
    data, config = _configs(raw[0].parent, tmp_path_factory.mktemp("faults-shards"))
    out = preprocess(data, TRANSFORM, config, progress=False)
    return data, config, out, {p.name: p.read_bytes() for p in out.iterdir() if not p.name.startswith(".")}


def _fresh(shards, tmp_path: Path) -> Path:
    """A copy of the reference directory under a new shards.root, for one test to damage."""
    out = shards[2]
    root = tmp_path / "shards"
    shutil.copytree(out, root / out.name)
    return root / out.name


def _rebuilt(shards, out: Path, capfd) -> list[str]:
    """``preprocess`` again: the ``satp:`` lines it printed; the directory equals the reference."""
    data, _, _, reference = shards
    capfd.readouterr()
    assert preprocess(data, TRANSFORM, ShardConfig(root=str(out.parent), graphs_per_shard=8), progress=False) == out
    lines = _satp_lines(capfd.readouterr().err)
    assert {p.name: p.read_bytes() for p in out.iterdir() if not p.name.startswith(".")} == reference
    return lines


_KILLED_SHARD = """
    import os, pickle, signal, sys
    from preprocessing import build, shards
    os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)  # written, not yet renamed into place
    build.write_shard(*pickle.loads(open(sys.argv[1], "rb").read()))
"""


def test_shard_killed_mid_write_is_named_and_only_it_is_rebuilt(shards, tmp_path, capfd):
    from preprocessing.build import plan_shards

    data, config, _, _ = shards
    out = _fresh(shards, tmp_path)
    plan = plan_shards(ColumnarStore(Path(data.root) / "ogbg_code2"), data, config)[2]
    (out / plan.file).unlink()
    (out / plan.sidecar).unlink()
    (out / MANIFEST).unlink()  # the state of a build killed while writing that shard
    args = tmp_path / "args.pkl"
    args.write_bytes(pickle.dumps((str(out / plan.file), str(Path(data.root) / "ogbg_code2"), plan.ids, "code2",
                                   TRANSFORM.model_dump(mode="json"), json.loads((out / VOCAB_FILE).read_text()))))
    assert _script(_KILLED_SHARD, args).wait(timeout=120) == -signal.SIGKILL
    assert [p.name.split(".tmp-")[0] for p in out.glob(".*.tmp-*")] == [f".{plan.file}"]
    kept = _stamps(out, "*.arrow")
    assert _rebuilt(shards, out, capfd) == [f"satp: rebuilding shard {out / plan.file}: its write was interrupted"]
    assert {k: v for k, v in _stamps(out, "*.arrow").items() if k != plan.file} == kept


SHARD_DAMAGE = {
    "truncated shard": (_cut, "train-00001.arrow", r"corrupt shard \(size \d+, manifest says \d+\)",
                        "rebuilding shard {f}: {n} bytes, {r} recorded (truncated or corrupt)"),
    "bit-flipped shard": (_flip, "train-00001.arrow", r"corrupt shard \(sha256 does not match the manifest\)",
                          "rebuilding shard {f}: its sha256 differs from the recorded one (corrupt)"),
    "unreadable manifest": (lambda p: p.write_text("{"), MANIFEST, r"unreadable manifest",
                            "writing {f} again: it is unreadable"),
    "bit-flipped vocab.json": (_flip, VOCAB_FILE, r"damaged vocabulary \(sha256 does not match",
                               "writing {f} again: it differs from the vocabulary of the train split (damaged)"),
}


@pytest.mark.parametrize("damage", list(SHARD_DAMAGE))
def test_shard_damaged_afterwards_is_named_by_readers_and_only_it_is_rebuilt(shards, tmp_path, capfd, damage):
    from preprocessing.reader import ShardDataset

    harm, name, read_error, said = SHARD_DAMAGE[damage]
    out = _fresh(shards, tmp_path)
    recorded = (out / name).stat().st_size
    kept = {k: v for k, v in _stamps(out, "*.arrow").items() if k != name}
    harm(out / name)
    with pytest.raises(ValueError, match=read_error) as info:  # what training or satp predict would meet
        ds = ShardDataset(out, "train")
        ds.verify_all()
        ds.vocab
    assert str(info.value).startswith(str(out / name)) and "\n" not in str(info.value)
    lines = _rebuilt(shards, out, capfd)
    assert lines == ["satp: " + said.format(f=out / name, n=recorded // 2, r=recorded)]
    assert {k: v for k, v in _stamps(out, "*.arrow").items() if k != name} == kept


def test_shard_with_an_unreadable_sidecar_mid_build_is_rebuilt(shards, tmp_path, capfd):
    out = _fresh(shards, tmp_path)
    (out / MANIFEST).unlink()  # a build in progress: the sidecars say what is finished
    (out / "valid-00000.json").write_text("garbage")
    kept = {k: v for k, v in _stamps(out, "*.arrow").items() if k != "valid-00000.arrow"}
    assert _rebuilt(shards, out, capfd) == [
        f"satp: rebuilding shard {out / 'valid-00000.arrow'}: its sidecar valid-00000.json is unreadable"]
    assert {k: v for k, v in _stamps(out, "*.arrow").items() if k != "valid-00000.arrow"} == kept


def test_shards_on_a_full_disk_name_the_file_and_resume_once_there_is_room(shards, small_disk, capfd):
    disk = small_disk.mount("8m")  # what is written there beyond it fails with ENOSPC
    data, _, reference_dir, reference = shards
    config = ShardConfig(root=str(disk / "shards"), graphs_per_shard=8)
    shard_bytes = sum(len(b) for n, b in reference.items() if n.endswith(".arrow"))
    filler = small_disk.fill(leave=shard_bytes // 2)
    with pytest.raises((ValueError, OSError)) as info:
        preprocess(data, TRANSFORM, config, progress=False)
    out = disk / "shards" / reference_dir.name
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(out) + "/") and "No space left on device" in message, message
    assert message.endswith(": free space there and run the same command again"), message
    assert "Error writing bytes" not in message and message.count(str(out)) == 1, message  # satp's words, not Arrow's
    assert not (out / MANIFEST).exists() and not list(out.glob(".*.tmp-*"))
    finished = _stamps(out, "*.arrow")
    finished = {k: v for k, v in finished.items() if (out / k.replace(".arrow", ".json")).is_file()}
    filler.unlink()
    for line in _rebuilt(shards, out, capfd):  # a shard written whose sidecar the full disk refused, if any
        assert line.startswith(f"satp: rebuilding shard {out}/") and line.endswith(
            ": its build was interrupted before it was recorded"), line
    assert {k: v for k, v in _stamps(out, "*.arrow").items() if k in finished} == finished


def test_shards_second_writer_waits_and_rebuilds_nothing(shards, tmp_path, ray_cluster, monkeypatch):
    import threading

    from preprocessing import build

    data, _, reference_dir, reference = shards
    root = tmp_path / "shards"
    paused, go, first = threading.Event(), threading.Event(), {}
    run = build._run_shard_tasks

    def pausing(*args, **kwargs):  # the first writer holds the directory's lock: it pauses before writing shards
        paused.set()
        go.wait(180)
        return run(*args, **kwargs)

    monkeypatch.setattr(build, "_run_shard_tasks", pausing)
    writer = threading.Thread(target=lambda: first.update(
        out=preprocess(data, TRANSFORM, ShardConfig(root=str(root), graphs_per_shard=8), progress=False)))
    writer.start()
    assert paused.wait(180)
    job = tmp_path / "job.yaml"
    job.write_text(f"name: t\nmodel: {{}}\ndata: {{name: ogbg-code2, root: {data.root}, source: pycode}}\n"
                   "transform: {rwpe_steps: 0, k_hops: 0, vocab_size: 300}\n"
                   f"shards: {{root: {root}, graphs_per_shard: 8}}\n")
    second = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "preprocess", str(job), "--no-progress",
                               "--address", ray_cluster.get_runtime_context().gcs_address], cwd=ROOT, env=_env(),
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = root / reference_dir.name
    try:
        line = _read_line_with(second, "waiting")
    finally:
        go.set()
        writer.join(180)
    assert line == (f"satp: the shard directory {out} is being written by satp (pid {os.getpid()} on "
                    f"{os.uname().nodename}): waiting for it to finish")
    assert first["out"] == out
    stamps = _stamps(out, "*")
    out2, err2 = second.communicate(timeout=180)
    assert second.returncode == 0, err2[-2000:]
    assert out2.strip() == str(out)
    assert _stamps(out, "*") == stamps and not _satp_lines(err2)  # the second wrote nothing
    assert {p.name: p.read_bytes() for p in out.iterdir() if not p.name.startswith(".")} == reference


# ============================================================================= the registry
@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory):
    """One SQLite MLflow store for the module's cases (creating one costs seconds)."""
    return sqlite_store(tmp_path_factory.mktemp("faults-registry"))


@pytest.fixture
def registry(mlflow_store, request):
    """The store, a new run, and a model name of this test's own."""
    uri, exp_id = mlflow_store
    return uri, exp_id, new_run(uri, exp_id), "".join(c if c.isalnum() else "-" for c in request.node.name)[:90]


_KILLED_REGISTRATION = """
    import os, signal, sys
    import mlflow
    from tests.helpers import register_tiny, tiny_model
    uri, run_id, name = sys.argv[1:4]
    # the model's files are logged; the version is not registered yet
    mlflow.register_model = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    register_tiny(tiny_model("pattern"), uri, run_id, name)
"""


def test_registration_killed_mid_write_registers_once_on_the_rerun(registry):
    from mlflow.tracking import MlflowClient

    from pipeline.registry.versions import load_model

    uri, _, run_id, name = registry
    assert _script(_KILLED_REGISTRATION, uri, run_id, name).wait(timeout=180) == -signal.SIGKILL
    client = MlflowClient(uri)
    assert client.search_model_versions(f"name='{name}'") == []  # killed before any version existed
    again = register_tiny(tiny_model("pattern"), uri, run_id, name)  # the rerun (a finished run registers now)
    assert again["version"] == 1 and len(client.search_model_versions(f"name='{name}'")) == 1
    assert load_model(f"models:/{name}/1", tracking_uri=uri).info["weights_sha256"]


def _registered_files(uri: str, name: str, version: int) -> Path:
    return stored_files(uri, name, version) / "artifacts"


def _flip_a_weight(path: Path) -> None:
    """Flip one bit inside the largest tensor's bytes of a torch.save zip (torch checks no CRC)."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as archive:
        entry = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "rb") as fh:
        fh.seek(entry.header_offset)
        name, extra = struct.unpack("<HH", fh.read(30)[26:30])
    _flip(path, entry.header_offset + 30 + name + extra + entry.file_size // 2)


REGISTRY_DAMAGE = {
    "truncated weights.pt": (lambda d: _cut(d / "weights.pt"),
                             "weights.pt is not a weights-only tensor file (not a complete zip archive as torch.save "
                             "writes, "),
    "bit-flipped weights.pt": (lambda d: _flip_a_weight(d / "weights.pt"),
                               "weights.pt does not match the weights_sha256 of satp_model.json"),
    "truncated satp_model.json": (lambda d: _cut(d / "satp_model.json"), "satp_model.json is damaged ("),
}


@pytest.mark.parametrize("damage", list(REGISTRY_DAMAGE))
def test_registry_artifact_damaged_afterwards_is_named_and_other_versions_serve(registry, tmp_path, capsys, damage):
    from pipeline.cli import main

    uri, _, run_id, name = registry
    register_tiny(tiny_model("pattern"), uri, run_id, name)
    register_tiny(tiny_model("pattern", seed=1), uri, run_id, name)
    harm, said = REGISTRY_DAMAGE[damage]
    harm(_registered_files(uri, name, 1))
    graphs = tmp_path / "graphs.json"
    graphs.write_text(json.dumps(PATTERN_GRAPHS))
    capsys.readouterr()
    assert main(["predict", f"models:/{name}/1", str(graphs), "--tracking-uri", uri]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"satp: error: models:/{name}/1: {said}"), err
    assert main(["predict", f"models:/{name}/2", str(graphs), "--tracking-uri", uri]) == 0  # the intact version serves


def test_registration_on_a_full_disk_names_the_store_and_registers_once_there_is_room(registry, small_disk):
    disk = small_disk.mount("8m")  # what is written there beyond it fails with ENOSPC
    from mlflow.tracking import MlflowClient

    from pipeline.registry.versions import load_model

    uri, _, _, name = registry
    client = MlflowClient(uri)
    artifacts = (disk / "artifacts").as_uri()
    run_id = new_run(uri, client.create_experiment(name, artifact_location=artifacts))
    filler = small_disk.fill(leave=8192)
    with pytest.raises(OSError) as info:
        register_tiny(tiny_model("pattern"), uri, run_id, name)
    assert str(info.value) == (f"{artifacts}: could not write the model's files (No space left on device); "
                               "nothing was registered")
    assert client.search_model_versions(f"name='{name}'") == []
    filler.unlink()
    assert register_tiny(tiny_model("pattern"), uri, run_id, name)["version"] == 1
    assert load_model(f"models:/{name}/1", tracking_uri=uri).info["format"] == 2


_SECOND_REGISTRATION = """
    import json, sys, time
    from pathlib import Path
    import mlflow
    from tests.helpers import register_tiny, tiny_model
    uri, run_id, name, marker = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
    register = mlflow.register_model

    def paused(*args, **kwargs):  # found no version holding the weights, logged them: pause here
        marker.touch()
        while marker.exists():
            time.sleep(0.05)
        return register(*args, **kwargs)

    mlflow.register_model = paused
    print(json.dumps(register_tiny(tiny_model("pattern"), uri, run_id, name)))
"""


def test_a_second_registration_of_the_same_weights_leaves_one_version(registry, tmp_path):
    from mlflow.tracking import MlflowClient

    uri, _, run_id, name = registry
    marker = tmp_path / "paused"
    first = _script(_SECOND_REGISTRATION, uri, run_id, name, marker, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _wait_for(marker, first)
    assert register_tiny(tiny_model("pattern"), uri, run_id, name)["version"] == 1  # the second writer, meanwhile
    marker.unlink()
    out, err = first.communicate(timeout=180)
    assert first.returncode == 0, err[-2000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["version"] == 1 and result["reason"] == (
        "weights registered meanwhile by another command as version 1 (same run, same sha256)")
    assert [int(v.version) for v in MlflowClient(uri).search_model_versions(f"name='{name}'")] == [1]
