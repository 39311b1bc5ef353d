"""Shards on an object store, end to end on a real S3 API server (moto on loopback, :mod:`s3_server`):
written by ``preprocess`` with ``shards.root`` an ``s3://`` URI, read back through the node's cache
equal to the same shards on local disk; an upload killed half way never read and redone by the
rerun alone; every fault one line naming the URI and what to do."""
from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from preprocessing import DataConfig, ShardConfig, TransformConfig, preprocess
from preprocessing.build import plan_shards
from preprocessing.columnar import ColumnarStore
from preprocessing.reader import ShardDataset
from preprocessing.shards import MANIFEST
from tests.helpers import small_python_source
from runtime.storage import StorageSettings, check, resolve, validate
from tests.s3_server import s3_server  # noqa: F401  (the session's server, a fixture)

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[1]
TRANSFORM = TransformConfig(rwpe_steps=4, k_hops=1, vocab_size=300)


@pytest.fixture(scope="module")
def built(tmp_path_factory, ray_cluster, s3_server):
    """A small code2 dataset's shards, on local disk and under an ``s3://`` prefix."""
    base = tmp_path_factory.mktemp("object-store")
    src = small_python_source(base / "src")
    data = DataConfig(name="ogbg-code2", root=str(base / "data"), source="pycode", source_dirs=[str(src)])
    local = preprocess(data, TRANSFORM, ShardConfig(root=str(base / "shards"), graphs_per_shard=16), progress=False)
    root = s3_server.prefix("shards")
    remote = preprocess(data, TRANSFORM, ShardConfig(root=root, graphs_per_shard=16), progress=False)
    return data, local, root, remote


def _objects(server, uri: str) -> dict[str, bytes]:
    """Every object below ``uri`` (name -> bytes), read behind satp's back."""
    bucket, prefix = uri.removeprefix("s3://").split("/", 1)
    client = server.client()
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])
    return {o["Key"].rsplit("/", 1)[1]: client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in listed}


def _key(uri: str) -> tuple[str, str]:
    bucket, key = uri.removeprefix("s3://").split("/", 1)
    return bucket, key


def _cache(tmp_path: Path, gb: float | None = None) -> StorageSettings:
    return StorageSettings(cache_dir=str(tmp_path / "cache"), cache_max_gb=gb)


def _same_graphs(a: ShardDataset, b: ShardDataset) -> None:
    assert len(a) == len(b)
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert set(x.keys()) == set(y.keys())
        for k in x.keys():
            assert torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k], k


def test_shards_written_to_s3_equal_the_local_ones_and_read_back_equal(built, s3_server, tmp_path, monkeypatch):
    data, local, root, remote = built
    assert remote == f"{root}/{local.name}"
    local_files = {p.name: p.read_bytes() for p in local.iterdir() if not p.name.startswith(".")}
    assert _objects(s3_server, remote) == local_files  # shards, sidecars, vocabulary and manifest
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the default cache folder
    from pipeline.train.loader import open_split

    for split in ("train", "valid", "test"):
        on_s3, on_disk = open_split(remote, split), ShardDataset(local, split)
        assert on_s3.manifest == on_disk.manifest and on_s3.vocab == on_disk.vocab
        _same_graphs(on_s3, on_disk)
        ids = list(range(len(on_disk)))[::-1]
        got, want = on_s3.batch(ids), on_disk.batch(ids)
        assert all(torch.equal(got[k], want[k]) for k in want.keys() if torch.is_tensor(want[k]))
    cached = sorted(p.name for p in (tmp_path / "xdg/satp/shards").glob("*.arrow"))
    manifest = json.loads(local_files[MANIFEST])
    assert cached == sorted(f"{s['sha256']}.arrow" for s in manifest["shards"])  # the shards and nothing else


def test_a_finished_store_directory_is_validated_without_uploading(built, s3_server):
    data, _, _, remote = built
    client = s3_server.client()
    bucket = f"satp-finished-{os.getpid()}"
    client.create_bucket(Bucket=bucket)
    client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})  # every write kept
    source_bucket, source = _key(remote)
    copy = f"shards/{remote.rsplit('/', 1)[1]}"
    for name in _objects(s3_server, remote):
        client.copy_object(Bucket=bucket, Key=f"{copy}/{name}", CopySource={"Bucket": source_bucket, "Key": f"{source}/{name}"})
    root = f"s3://{bucket}/shards"
    assert preprocess(data, TRANSFORM, ShardConfig(root=root, graphs_per_shard=16), progress=False) == f"s3://{bucket}/{copy}"
    listed = client.list_object_versions(Bucket=bucket, Prefix="shards/")
    assert listed.get("DeleteMarkers", []) == []  # nothing deleted, not even a write check's probe
    versions = [v["Key"] for v in listed["Versions"]]
    assert sorted(versions) == sorted(f"{copy}/{name}" for name in _objects(s3_server, remote))  # nothing written


_KILLED_UPLOAD = """
    import os, pickle, signal, sys
    from preprocessing import build, shard_places
    path, half = sys.argv[2], int(sys.argv[3])
    real = shard_places.HashingSink.write

    def write(self, data):  # half the shard's bytes handed to the upload: killed, as by the OOM killer
        written = real(self, data)
        if self.size >= half:
            os.kill(os.getpid(), signal.SIGKILL)
        return written

    shard_places.HashingSink.write = write
    build.write_shard(path, *pickle.loads(open(sys.argv[1], "rb").read()))
"""


def test_an_upload_killed_half_way_is_never_read_and_the_rerun_redoes_only_it(built, s3_server, tmp_path):
    import pickle

    data, local, _, _ = built
    client = s3_server.client()
    bucket = f"satp-versioned-{os.getpid()}"
    client.create_bucket(Bucket=bucket)
    client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    config = ShardConfig(root=f"s3://{bucket}/shards", graphs_per_shard=16)
    out = preprocess(data, TRANSFORM, config, progress=False)
    plan = plan_shards(ColumnarStore(Path(data.root) / "ogbg_code2"), data, config)[1]
    shard_bytes = (local / plan.file).stat().st_size
    for name in (MANIFEST, plan.file, plan.sidecar):  # the state of a build killed while uploading that shard
        client.delete_object(Bucket=bucket, Key=f"shards/{out.rsplit('/', 1)[1]}/{name}")

    def versions() -> dict[str, int]:
        """Every object of the shard directory -> how many times it was written."""
        counts: dict[str, int] = {}
        for v in client.list_object_versions(Bucket=bucket, Prefix=_key(out)[1] + "/").get("Versions", []):
            counts[v["Key"].rsplit("/", 1)[1]] = counts.get(v["Key"].rsplit("/", 1)[1], 0) + 1
        return counts

    before = versions()
    args = tmp_path / "args.pkl"
    vocab = json.loads((local / "vocab.json").read_text())
    args.write_bytes(pickle.dumps((str(Path(data.root) / "ogbg_code2"), plan.ids, "code2",
                                   TRANSFORM.model_dump(mode="json"), vocab)))
    script = tmp_path / "kill.py"
    script.write_text(textwrap.dedent(_KILLED_UPLOAD))
    proc = subprocess.run([sys.executable, str(script), str(args), f"{out}/{plan.file}", str(shard_bytes // 2)],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    uploads = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert [u["Key"].rsplit("/", 1)[1] for u in uploads] == [plan.file]  # begun, never completed
    assert versions() == before  # no object of it, complete or not
    with pytest.raises(ValueError, match=f"^{out}/{MANIFEST}: no manifest: not a finished shard directory"):
        ShardDataset(out, "train", storage=_cache(tmp_path))
    assert preprocess(data, TRANSFORM, config, progress=False) == out
    after = versions()
    rewritten = {k for k in after if after[k] != before.get(k)}
    assert rewritten == {plan.file, plan.sidecar, MANIFEST}  # only what the killed build had not finished
    _same_graphs(ShardDataset(out, "train", storage=_cache(tmp_path)), ShardDataset(local, "train"))


def test_a_deleted_or_corrupted_object_is_fetched_again_then_refused_by_name(built, s3_server, tmp_path):
    data, local, _, remote = built
    client = s3_server.client()
    bucket, prefix = _key(remote)
    copy = f"{prefix}-damaged"
    for name, body in _objects(s3_server, remote).items():
        client.put_object(Bucket=bucket, Key=f"{copy}/{name}", Body=body)
    uri = f"s3://{bucket}/{copy}"
    first, second = json.loads((local / MANIFEST).read_text())["shards"][:2]
    flipped = bytearray((local / second["file"]).read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF
    client.put_object(Bucket=bucket, Key=f"{copy}/{second['file']}", Body=bytes(flipped))  # same size
    ds = ShardDataset(uri, "train", storage=_cache(tmp_path))
    client.delete_object(Bucket=bucket, Key=f"{copy}/{first['file']}")  # after the reader listed it
    with pytest.raises(ValueError) as missing:
        ds[0]
    assert str(missing.value) == (f"{uri}/{first['file']}: shard missing on the store (the manifest lists it), "
                                  "fetched twice; run `satp preprocess JOB.yaml`: it writes the missing shards again")
    with pytest.raises(ValueError) as corrupt:
        ds[16]
    assert str(corrupt.value) == (f"{uri}/{second['file']}: shard corrupt on the store (sha256 does not match the "
                                  "manifest), fetched twice; delete the object and run `satp preprocess JOB.yaml`: "
                                  "only it is written again")
    for bad in (first, second):  # nothing of them kept on the node, not even half a download
        assert not list((tmp_path / "cache").glob(f"{bad['sha256']}.arrow*"))
        assert not list((tmp_path / "cache").glob(f".{bad['sha256']}.arrow.tmp-*"))


def test_a_changed_or_deleted_checkpoint_object_is_named_and_the_intact_one_before_resumed(s3_server, tmp_path, capfd):
    """Checkpoints on the store, uploaded by satp's writer: an object of the newest changed behind its
    back (same size, other bytes), then one of the next deleted. Each is named by its URI in one
    warning line, never resumed from; the intact one before is, downloaded whole."""
    from pipeline.train.checkpoint import CheckpointManager
    from tests.helpers import checkpoint_part, satp_lines

    run = f"{s3_server.prefix('runs')}/r"
    parts = [checkpoint_part(tmp_path / f"local-{epoch}", epoch) for epoch in range(3)]
    names = [CheckpointManager(run).write(part, rank=0, epoch=epoch) for epoch, part in enumerate(parts)]
    client, (bucket, prefix) = s3_server.client(), _key(run)
    states = "ds/last/mp_rank_00_model_states.pt"
    changed = bytearray(client.get_object(Bucket=bucket, Key=f"{prefix}/{names[2]}/{states}")["Body"].read())
    changed[7] ^= 0xFF
    client.put_object(Bucket=bucket, Key=f"{prefix}/{names[2]}/{states}", Body=bytes(changed))
    client.delete_object(Bucket=bucket, Key=f"{prefix}/{names[1]}/best_model.pt")
    capfd.readouterr()
    manager = CheckpointManager(run)
    assert manager.newest_intact() == names[0]
    assert satp_lines(capfd.readouterr().err) == [
        f"satp: warning: {run}/{names[2]}/{states}: its content differs from what was written (sha256 mismatch: "
        f"changed since); checkpoint {names[2]} (epoch 2) is damaged and not resumed from; the run goes on from "
        f"{names[0]} (epoch 0)",
        f"satp: warning: {run}/{names[1]}/best_model.pt: missing; checkpoint {names[1]} (epoch 1) is damaged and not "
        f"resumed from; the run goes on from {names[0]} (epoch 0)"]
    with manager.local(names[0]) as folder:
        assert {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()} == \
            {p.relative_to(parts[0]).as_posix(): p.read_bytes() for p in parts[0].rglob("*") if p.is_file()}


def test_a_damaged_or_evicted_cached_copy_is_fetched_again(built, tmp_path):
    _, local, _, remote = built
    settings = _cache(tmp_path)
    reference = ShardDataset(local, "valid")
    _same_graphs(ShardDataset(remote, "valid", storage=settings), reference)
    cached = sorted((tmp_path / "cache").glob("*.arrow"))
    payload = bytearray(cached[0].read_bytes())
    payload[100] ^= 0xFF
    cached[0].write_bytes(bytes(payload))  # damaged on the node's disk
    if len(cached) > 1:
        cached[1].unlink()  # or removed
    _same_graphs(ShardDataset(remote, "valid", storage=settings), reference)
    sha = cached[0].name.removesuffix(".arrow")
    manifest = json.loads((local / MANIFEST).read_text())
    name = next(s["file"] for s in manifest["shards"] if s["sha256"] == sha)
    assert cached[0].read_bytes() == (local / name).read_bytes()


def test_the_cache_is_bounded_and_evicts_only_shards_no_reader_maps(built, tmp_path):
    _, local, _, remote = built
    manifest = json.loads((local / MANIFEST).read_text())
    size = {split: sum(s["bytes"] for s in manifest["shards"] if s["split"] == split) for split in ("train", "valid")}
    with pytest.raises(ValueError) as small:
        ShardDataset(remote, "train", storage=_cache(tmp_path, gb=1e-9))
    assert str(small.value).startswith(f"{remote}: the train split's reader needs ") and \
        str(small.value).endswith("; raise storage.cache_max_gb, or set storage.cache_dir to a larger disk")
    settings = _cache(tmp_path, gb=(max(size.values()) + 1) / 1e9)  # one split at a time
    train = ShardDataset(remote, "train", storage=settings)
    train.num_nodes  # every train shard fetched and mapped
    valid = ShardDataset(remote, "valid", storage=settings)
    with pytest.raises(ValueError, match=r"no room in the shard cache .* of shards in use of .* raise storage.cache_max_gb"):
        valid[0]
    del train
    gc.collect()  # no reader maps the train shards any more
    _same_graphs(ShardDataset(remote, "valid", storage=settings), ShardDataset(local, "valid"))
    held = sum(p.stat().st_size for p in (tmp_path / "cache").glob("*.arrow"))
    assert held <= settings.cache_max_gb * 1e9 and held >= size["valid"]


def test_settings_name_the_endpoint_over_the_standard_variables(s3_server, monkeypatch):
    dead = f"http://127.0.0.1:{_dead_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    check(s3_server.prefix("x"), settings=StorageSettings(endpoint_url=s3_server.url))  # the job's wins
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.url)
    check(s3_server.prefix("x"))  # the S3 one over the general one
    assert resolve("s3://satp-tests/p").endpoint == s3_server.url


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


@pytest.fixture
def silent_server():
    """A loopback server that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held = []
    threading.Thread(target=lambda: [held.append(listener.accept()) for _ in range(64)], daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


FAULTS = {
    "unreachable endpoint": (lambda srv, silent: {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{_dead_port()}"},
                             "cannot reach http://127.0.0.1:", "check storage.endpoint_url (or AWS_ENDPOINT_URL)"),
    "endpoint that does not answer": (lambda srv, silent: {"AWS_ENDPOINT_URL": silent}, "cannot reach http://127.0.0.1:",
                                      "Timeout was reached"),
    "wrong credentials": (lambda srv, silent: {"AWS_ACCESS_KEY_ID": "AKIANOBODY", "AWS_SECRET_ACCESS_KEY": "x"},
                          "refused the credentials", "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"),
    "wrong secret": (lambda srv, silent: {"AWS_SECRET_ACCESS_KEY": "not-the-secret"}, "refused the credentials",
                     "to a key it knows"),
    "missing bucket": (lambda srv, silent: {}, "the bucket 'satp-no-such-bucket' does not exist", "create it"),
    "no write permission": (lambda srv, silent: dict(zip(("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"),
                                                         srv.keys["reader"])),
                            "access denied writing it", "grant them write access (S3: s3:PutObject"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_the_preflight_names_each_fault_in_one_line_within_seconds(s3_server, silent_server, monkeypatch, fault):
    env, said, todo = FAULTS[fault]
    for k, v in env(s3_server, silent_server).items():
        monkeypatch.setenv(k, v)
    uri = "s3://satp-no-such-bucket/shards" if fault == "missing bucket" else s3_server.prefix("preflight")
    started = time.monotonic()
    with pytest.raises(ValueError) as info:
        check(uri, write=True)
    message = str(info.value)
    assert time.monotonic() - started < 15
    assert message.startswith(f"{uri}: ") and "\n" not in message and said in message and todo in message, message
    if fault == "no write permission":
        check(uri, write=False)  # reading is allowed: the reader's key is fine for training


def test_satp_preprocess_names_a_store_fault_in_one_line(built, s3_server, tmp_path, ray_cluster):
    """The command's view: ``satp: error: <line>`` and status 2, nothing written anywhere."""
    data, _, _, _ = built
    job = tmp_path / "job.yaml"
    job.write_text(f"name: t\nmodel: {{}}\ndata: {{name: ogbg-code2, root: {data.root}, source: pycode}}\n"
                   "transform: {rwpe_steps: 4, k_hops: 1, vocab_size: 300}\n"
                   "shards: {root: 's3://satp-no-such-bucket/shards', graphs_per_shard: 16}\n")
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "preprocess", str(job), "--no-progress",
                           "--address", ray_cluster.get_runtime_context().gcs_address], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("satp:")]
    assert proc.returncode == 2 and lines == [
        "satp: error: s3://satp-no-such-bucket/shards: the bucket 'satp-no-such-bucket' does not exist at "
        f"{s3_server.url}; create it, or correct the URI"], proc.stderr[-2000:]
    assert not (tmp_path / "s3:").exists()


@pytest.mark.parametrize("value, said", [
    ("s3:/satp-bar/shards", "'s3:/satp-bar/shards' is neither a path nor a URI (a URI has two slashes: "
                            "s3://satp-bar/shards)"),
    ("s3://b1/shards", "'b1' is not a bucket name"),
    ("nosuchfs://x/y", "no file system for scheme 'nosuchfs'"),
    ("s3://satp-bar/shards?endpoint_override=x", "the store's settings go in the job's storage section"),
])
def test_a_uri_the_product_cannot_use_is_refused_in_one_line(value, said):
    with pytest.raises(ValueError) as info:
        resolve(value, key="shards.root")
    assert str(info.value).startswith("shards.root: ") and said in str(info.value), str(info.value)


def test_paths_stay_paths_and_file_uris_become_them(tmp_path):
    assert validate("runs/shards", "k") == "runs/shards" and validate(f"file://{tmp_path}", "k") == str(tmp_path)
    assert resolve("runs/shards").local and resolve("s3://satp-bar/shards/").uri == "s3://satp-bar/shards"
    with pytest.raises(ValueError, match="only shards.root may be a URI"):
        DataConfig(name="ogbg-ppa", root="s3://satp-bar/data")


def test_an_fsspec_file_system_is_wrapped_for_pyarrow(built, tmp_path):
    """A protocol pyarrow.fs does not know, through fsspec: the reader reads a shard directory there."""
    import fsspec

    _, local, _, _ = built
    memory = fsspec.filesystem("memory")
    for p in local.iterdir():
        if not p.name.startswith("."):
            memory.pipe(f"/satp-fsspec/{local.name}/{p.name}", p.read_bytes())
    loc = resolve(f"memory://satp-fsspec/{local.name}")
    assert type(loc.fs).__name__ == "PyFileSystem"
    _same_graphs(ShardDataset(loc.uri, "test", storage=_cache(tmp_path)), ShardDataset(local, "test"))
