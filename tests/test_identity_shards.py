"""A shard directory's identity is its configuration and its raw data (preprocessing.build.shard_dir).

Two datasets under one ``shards.root`` never share a directory; the raw files' fingerprint that
names it is cached by their stat signature (no full read per command), and never trusted after a
write; ``satp preprocess --force`` rebuilds beside the old directory and swaps it in only when complete.
"""
from __future__ import annotations

import json
import os
import types
from pathlib import Path

import pytest
import yaml

from pipeline.cli import main
from preprocessing import DataConfig, ShardConfig, TransformConfig, preprocess, shard_dir
from preprocessing import columnar
from preprocessing.columnar import FINGERPRINT_FILE, STORE_DIR, raw_fingerprint
from preprocessing.pycode import build_pycode
from preprocessing.synthetic import build_synthetic_ppa
from tests.helpers import small_python_source

TRANSFORM = TransformConfig(rwpe_steps=0, k_hops=0)


def _code2(root: Path) -> DataConfig:
    """A job's data section for a folder built by ``satp data pycode`` (the same for any sources)."""
    return DataConfig(name="ogbg-code2", root=str(root), source="pycode")


def _clock(monkeypatch, now_ns):
    """``columnar``'s clock, as the racy-file rule reads it."""
    monkeypatch.setattr(columnar, "time", types.SimpleNamespace(time_ns=now_ns))


def _counting_hashes(monkeypatch) -> list:
    """Count the full reads of a dataset (one sha256 per fingerprint taken)."""
    import hashlib

    calls = []
    monkeypatch.setattr(columnar, "hashlib", types.SimpleNamespace(sha256=lambda b: calls.append(1) or hashlib.sha256(b)))
    return calls


def _last_change(folder: Path) -> int:
    return max(max(s.st_mtime_ns, s.st_ctime_ns) for s in (p.stat() for p in folder.rglob("*.csv.gz")))


# ----------------------------------------------------------------------------- the fingerprint's cache
def test_fingerprint_is_read_once_and_then_kept_by_stat_signature(tmp_path, monkeypatch):
    build_synthetic_ppa(tmp_path, 9)
    folder = tmp_path / "ogbg_ppa"
    reads = _counting_hashes(monkeypatch)
    _clock(monkeypatch, lambda: _last_change(folder) + 10**10)  # the files settled 10 s before
    first = raw_fingerprint(folder, "ogbg-ppa")
    assert raw_fingerprint(folder, "ogbg-ppa") == first and len(reads) == 1  # the second one only stats
    assert json.loads((folder / STORE_DIR / FINGERPRINT_FILE).read_text())["fingerprint"] == first

    # rewritten in place, same size, modification time set back: the change time gives it away
    path = folder / "raw/edge.csv.gz"
    stat = path.stat()
    payload = bytearray(path.read_bytes())
    payload[len(payload) // 2] ^= 0xFF
    path.write_bytes(bytes(payload))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    second = raw_fingerprint(folder, "ogbg-ppa")
    assert second != first and len(reads) == 2
    (folder / STORE_DIR / FINGERPRINT_FILE).unlink()
    assert raw_fingerprint(folder, "ogbg-ppa") == second  # what a full read gives


def test_files_changed_just_before_hashing_are_not_cached(tmp_path, monkeypatch):
    """A file-system clock coarser than the writes could hide a second write within the same tick:
    a fingerprint taken less than 2 s after a change is used, not kept."""
    build_synthetic_ppa(tmp_path, 9)
    folder = tmp_path / "ogbg_ppa"
    reads = _counting_hashes(monkeypatch)
    _clock(monkeypatch, lambda: _last_change(folder) + 10**9)  # 1 s after the last write
    first = raw_fingerprint(folder, "ogbg-ppa")
    assert raw_fingerprint(folder, "ogbg-ppa") == first and len(reads) == 2
    assert not (folder / STORE_DIR / FINGERPRINT_FILE).exists()


# ----------------------------------------------------------------------------- one shards.root, two datasets
@pytest.mark.ray
def test_two_datasets_under_one_shards_root_never_collide(ray_cluster, tmp_path):
    """Switching ``data.root`` or rebuilding the raw files gives new shards, never the error about
    another dataset's shards; the first dataset's shards stay as they were."""
    json_src = small_python_source(tmp_path / "src-a", ("json",)) / "json"  # its 5 modules, as `--source <stdlib>/json`
    more_src = small_python_source(tmp_path / "src-b", ("json", "csv.py", "shlex.py"))
    build_pycode(tmp_path / "a", [str(json_src)])
    build_pycode(tmp_path / "b", [str(more_src)])
    shards = ShardConfig(root=str(tmp_path / "shards"), graphs_per_shard=64)
    a = preprocess(_code2(tmp_path / "a"), TRANSFORM, shards, progress=False)
    b = preprocess(_code2(tmp_path / "b"), TRANSFORM, shards, progress=False)
    assert a != b and a.parent == b.parent and a.name[:-12] == b.name[:-12]  # one configuration
    stamp = (a / "manifest.json").stat().st_mtime_ns
    for out in (a, b):
        assert out.name.endswith(json.loads((out / "manifest.json").read_text())["source"]["fingerprint"][:12])

    build_pycode(tmp_path / "a", [str(more_src)], force=True)  # a's raw files rebuilt from other sources
    again = preprocess(_code2(tmp_path / "a"), TRANSFORM, shards, progress=False)
    assert again == b == shard_dir(_code2(tmp_path / "a"), TRANSFORM, shards)  # the same bytes as b's: its shards
    assert (a / "manifest.json").stat().st_mtime_ns == stamp


# ----------------------------------------------------------------------------- satp preprocess --force
def _shards_job(tmp_path: Path) -> Path:
    build_synthetic_ppa(tmp_path / "data", 12)
    job = {"name": "t", "model": {}, "data": {"name": "ogbg-ppa", "root": str(tmp_path / "data")},
           "transform": {"rwpe_steps": 2, "k_hops": 0}, "shards": {"root": str(tmp_path / "shards"), "graphs_per_shard": 4}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _files(out: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_ino, p.read_bytes()) for p in sorted(out.iterdir())}


@pytest.mark.ray
def test_preprocess_force_rebuilds_and_swaps_in_when_complete(ray_cluster, tmp_path, capsys, monkeypatch):
    import preprocessing.build as build

    job = _shards_job(tmp_path)
    assert main(["preprocess", str(job), "--no-progress"]) == 0
    out = Path(capsys.readouterr().out.strip().splitlines()[-1])
    before = _files(out)
    assert main(["preprocess", str(job), "--no-progress"]) == 0 and _files(out) == before  # nothing to do

    # a rebuild that fails half-way leaves the old directory as it was, and nothing beside it
    def fail(*args, **kwargs):
        raise ValueError("shard task failed")

    with monkeypatch.context() as m:
        m.setattr(build, "_run_shard_tasks", fail)
        assert main(["preprocess", str(job), "--no-progress", "--force"]) == 2
    assert "satp: error: shard task failed" in capsys.readouterr().err
    beside = lambda: [p.name for p in out.parent.iterdir() if p.name != f".{out.name}.lock"]  # (its writer lock)
    assert _files(out) == before and beside() == [out.name]

    (out.parent / f".{out.name}.rebuild-0badc0de").mkdir()  # what a killed rebuild leaves
    assert main(["preprocess", str(job), "--no-progress", "--force"]) == 0
    assert Path(capsys.readouterr().out.strip().splitlines()[-1]) == out
    after = _files(out)
    assert {k: v[1] for k, v in after.items()} == {k: v[1] for k, v in before.items()}  # the same bytes
    assert all(after[k][0] != before[k][0] for k in after)  # every file written again
    assert beside() == [out.name]


@pytest.mark.ray
def test_a_directory_of_other_raw_data_under_the_name_is_rebuilt_by_force(ray_cluster, tmp_path, capsys):
    """The name holds 12 hex digits of the fingerprint: a directory copied under another's name (or
    a collision) is caught by the manifest's whole fingerprint, and ``--force`` replaces it."""
    job = _shards_job(tmp_path)
    assert main(["preprocess", str(job), "--no-progress"]) == 0
    out = Path(capsys.readouterr().out.strip().splitlines()[-1])
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["source"]["fingerprint"] = "0" * 64
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert main(["preprocess", str(job), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "built from other source data" in err[0] and "--force" in err[0], err
    assert main(["preprocess", str(job), "--no-progress", "--force"]) == 0
    assert json.loads((out / "manifest.json").read_text())["source"]["fingerprint"] != "0" * 64
