"""Preprocessing: OGB graph datasets into Arrow shards with SAT's precomputed features.

    path = preprocess(data, transform, shards)       # build / resume / validate -> shard directory
    path = shard_dir(data, transform, shards)        # the same directory, building nothing
    ds = preprocessing.reader.ShardDataset(path, "train")   # ds[i] -> SATData

``shards.root`` may be a URI (``s3://bucket/prefix``); then pass ``storage=`` the job's settings.
See ``docs/shards.md`` and ``docs/data.md``."""
from preprocessing.config import DataConfig, ShardConfig, TransformConfig, config_hash

__all__ = ["DataConfig", "ShardConfig", "TransformConfig", "config_hash", "preprocess", "shard_dir"]


def __getattr__(name: str):
    # lazy: `pipeline.config` imports `preprocessing.config`, which must not pull in torch / PyG
    if name in ("preprocess", "shard_dir"):
        from preprocessing import build

        return getattr(build, name)
    raise AttributeError(f"module 'preprocessing' has no attribute {name!r}")
