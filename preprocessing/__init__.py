"""Preprocessing: OGB graph datasets into Arrow shards with SAT's precomputed features.

Public API (used by the training pipeline)::

    from preprocessing import DataConfig, TransformConfig, ShardConfig, preprocess, shard_dir
    from preprocessing.reader import ShardDataset

    path = preprocess(data, transform, shards, address=None)  # build / resume / validate -> shard dir
    path = preprocess(data, transform, shards, force=True)    # built again, swapped in when complete
    path = shard_dir(data, transform, shards)                 # the same directory, building nothing (the
                                                              # raw files' fingerprint: cached by stat)
    uri = preprocess(data, transform, shards, storage=settings)  # shards.root s3://bucket/prefix: the URI
    ds = ShardDataset(path, "train")                          # len(ds), ds[i] -> SATData,
                                                              # ds.num_nodes, ds.manifest, ds.vocab
    ds = ShardDataset(uri, "train", storage=settings)         # through the node's shard cache
    graphs = preprocessing.reader.featurise(raws, task, transform, vocab)  # new inputs, as in training

- :mod:`preprocessing.config`: the ``data`` / ``transform`` / ``shards`` job sections.
- :mod:`preprocessing.sources`: where a dataset comes from (offline builders, OGB's download) and
  :func:`~preprocessing.sources.load_source`.
- :mod:`preprocessing.columnar`: the columnar raw store (memory-mapped Arrow, per-graph offsets) and
  :mod:`preprocessing.conversion`: OGB's raw CSVs into it, streaming, with the input checks of
  :mod:`preprocessing.raw_checks` (the range of every raw value).
- :mod:`preprocessing.locks`: one writer at a time for a store or a shard directory.
- :mod:`preprocessing.pycode`: Python source -> ogbg-code2 raw layout (``satp data pycode``), from
  :mod:`preprocessing.source_files` (which files, the project of each) and
  :mod:`preprocessing.python_graphs` (one function -> its graph, OGB's ``py2graph`` rules).
- :mod:`preprocessing.synthetic`: synthetic ogbg-ppa raw layout (``satp data synthetic-ppa``).
- :mod:`preprocessing.sbm`: PATTERN / CLUSTER by the SBM recipe of Dwivedi et al., OGB-like layout
  (``satp data sbm-pattern``, ``satp data sbm-cluster``).
- :mod:`preprocessing.transforms`: per-graph transforms (augment_edge, targets, RWPE, LapPE,
  k-hop subgraph indices, degree).
- :mod:`preprocessing.shards`: the shard format (schema version 1) and manifest.
- :mod:`preprocessing.shard_places`: a shard directory in a folder or on an object store
  (:mod:`runtime.storage`), one set of operations for both.
- :mod:`preprocessing.build`: the Ray-parallel build with resume.
- :mod:`preprocessing.reader`: :class:`~preprocessing.reader.ShardDataset`, and
  :mod:`preprocessing.shard_cache`: the node's bounded cache of the shards it reads from a store.
"""
from preprocessing.config import DataConfig, ShardConfig, TransformConfig, config_hash

__all__ = ["DataConfig", "ShardConfig", "TransformConfig", "config_hash", "preprocess", "shard_dir"]


def __getattr__(name: str):
    # lazy: `pipeline.config` imports `preprocessing.config`, which must not pull in torch / PyG
    if name in ("preprocess", "shard_dir", "build_shards"):
        from preprocessing import build

        return getattr(build, name)
    raise AttributeError(f"module 'preprocessing' has no attribute {name!r}")
