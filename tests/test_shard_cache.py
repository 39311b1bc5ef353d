"""The node's shard cache on a real S3 API server (moto on loopback, :mod:`s3_server`): a split larger
than the cache streams through it, evicting what the reader read longest ago, and never holds more
than its bound; a cache that cannot hold a shard and the next is refused in one line; a reader keeps
no shard page resident."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from preprocessing import DataConfig, ShardConfig, TransformConfig, preprocess
from preprocessing.reader import ShardDataset
from preprocessing.shards import MANIFEST
from runtime.storage import StorageSettings
from tests.s3_server import s3_server  # noqa: F401  (the session's server, a fixture)

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def shards(tmp_path_factory, ray_cluster, s3_server):
    """Synthetic ppa shards of 4 graphs each, written straight to the store; and their manifest."""
    base = tmp_path_factory.mktemp("shard-cache")
    data = DataConfig(name="ogbg-ppa", root=str(base / "data"), source="synthetic", synthetic_graphs=40)
    remote = preprocess(data, TransformConfig(rwpe_steps=4, k_hops=1), ShardConfig(root=s3_server.prefix("cache"),
                        graphs_per_shard=4), progress=False)
    bucket, key = remote.removeprefix("s3://").split("/", 1)
    manifest = json.loads(s3_server.client().get_object(Bucket=bucket, Key=f"{key}/{MANIFEST}")["Body"].read())
    return remote, [s for s in manifest["shards"] if s["split"] == "train"]


def _settings(tmp_path: Path, name: str, nbytes: float | None = None) -> StorageSettings:
    return StorageSettings(cache_dir=str(tmp_path / name), cache_max_gb=None if nbytes is None else nbytes / 1e9)


def _held(folder: Path) -> int:
    """Bytes of shards in the cache folder, downloads in progress at their full size (each shard once:
    the read-ahead's downloads go on meanwhile, and one may be renamed into place between the listings)."""
    sizes = {}
    for pattern in (".*.arrow.tmp-*", "*.arrow"):
        for path in folder.glob(pattern):
            try:
                sizes[path.name.lstrip(".").split(".")[0]] = path.stat().st_size
            except FileNotFoundError:
                continue  # renamed or evicted meanwhile
    return sum(sizes.values())


def _equal(a, b) -> None:
    assert sorted(a.keys()) == sorted(b.keys())
    for key in b.keys():
        assert torch.equal(a[key], b[key]) if torch.is_tensor(b[key]) else a[key] == b[key], key


def test_a_split_larger_than_the_cache_streams_through_it_within_the_bound(shards, tmp_path):
    remote, train = shards
    sizes = sorted(s["bytes"] for s in train)
    assert len(train) >= 6
    bound = sum(sizes[-3:])  # three shards of the split's six or more
    small = ShardDataset(remote, "train", storage=_settings(tmp_path, "small", bound))
    whole = ShardDataset(remote, "train", storage=_settings(tmp_path, "whole"))
    folder = tmp_path / "small"
    for epoch in range(2):  # the second pass fetches again what the first evicted
        for i in range(len(whole)):
            _equal(small[i], whole[i])
            assert _held(folder) <= bound
        for lo in range(0, len(whole), 6):  # batches across two shards at most
            ids = np.arange(lo, min(lo + 6, len(whole)))[::-1]
            _equal(small.batch(ids), whole.batch(ids))
            assert _held(folder) <= bound
    cached = {p.name.removesuffix(".arrow") for p in folder.glob("*.arrow")}
    assert 2 <= len(cached) < len(train) and cached <= {s["sha256"] for s in train}
    assert small.num_nodes.tolist() == whole.num_nodes.tolist()  # every shard once more, a few at a time


def test_a_cache_that_cannot_hold_a_shard_and_the_next_is_refused_in_one_line(shards, tmp_path):
    remote, train = shards
    two = sum(sorted(s["bytes"] for s in train)[-2:])
    with pytest.raises(ValueError) as info:
        ShardDataset(remote, "train", storage=_settings(tmp_path, "tiny", two - 1))
    message = str(info.value)
    assert "\n" not in message and re.fullmatch(
        rf"{re.escape(remote)}: the train split's reader needs [\d.]+ MB of shards at once \(one read, the next "
        rf"downloading\), more than the shard cache {re.escape(str(tmp_path / 'tiny'))} may hold "
        r"\(storage.cache_max_gb=[\d.e-]+\); raise storage.cache_max_gb, or set storage.cache_dir to a larger disk",
        message), message
    ShardDataset(remote, "train", storage=_settings(tmp_path, "enough", two))[0]
    assert not list((tmp_path / "tiny").glob("*.arrow"))  # nothing fetched for the refused reader


def _mapped_kib(folder: Path) -> int:
    """Resident KiB of this process's mappings of files in ``folder`` (``/proc/self/smaps``)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$", line)
        if head:
            inside = head.group(1).startswith(str(folder) + "/")
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_a_reader_keeps_none_of_the_shards_it_reads_resident(shards, tmp_path):
    """Tensor values are read, not mapped: a whole split read leaves no shard page in the reader's resident set."""
    remote, train = shards
    ds = ShardDataset(remote, "train", storage=_settings(tmp_path, "cache"))
    whole = list(range(len(ds)))[::-1]
    for i in whole:
        ds[i]
    ds.batch(whole)
    assert _mapped_kib(tmp_path / "cache") <= 16 * len(train)  # a few pages a shard at most, of a MiB or more each



def test_two_readers_of_one_cache_read_the_shards_the_other_holds(shards, tmp_path):
    """Two readers of one node's cache (two ranks, a rank and its loader workers): a second process reads,
    and downloads ahead, the shards this one holds open, without waiting for them to be closed."""
    remote, _ = shards
    settings = _settings(tmp_path, "shared")
    first = ShardDataset(remote, "train", storage=settings)
    first.batch(list(range(len(first))))  # every shard of the split open (held) here
    second = ("from preprocessing.reader import ShardDataset; from runtime.storage import StorageSettings; "
              f"ds = ShardDataset({remote!r}, 'train', storage=StorageSettings(cache_dir={settings.cache_dir!r})); "
              "print(sum(int(ds[i].num_nodes) for i in range(len(ds))))")
    # a reader that waits for this one's shards never returns: the timeout ends it
    done = subprocess.run([sys.executable, "-c", second], capture_output=True, text=True, timeout=180,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) == int(first.num_nodes.sum())
