"""Graphs as a job's shards hold them, without shards: the model, task and data of any job file.

:func:`job_graphs` draws synthetic raw graphs of the job's task (code2: random ASTs of
:mod:`benchmarks.graphs.synthetic`'s code2 shapes with random method-name subtokens; ppa: the synthetic
ppa recipe; pattern / cluster: the SBM recipes) and turns them into items exactly as training data
are made (:func:`preprocessing.reader.featurise`: the job's transform, the shard encoding, the
decoding). It also builds the job's task and its model config (the task's encoders and head; PNA's
degree histogram from the graphs), so a benchmark or a test runs a job file's own model on data
of its own layout. :func:`job_shards` writes the same graphs as a shard directory (train, valid
and test splits, the manifest and vocabulary as ``satp preprocess`` writes them), for what needs the
product's trainer or loaders (:func:`pipeline.train.plan.worker_setup` on it).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from pipeline.config import JobConfig
from pipeline.tasks import Task, make_task, task_name_for
from preprocessing.reader import featurise
from sat.config import SATConfig
from sat.data import SATData


def _code2_raws(n: int, rng: np.random.Generator) -> list[dict]:
    from benchmarks.graphs.synthetic import NUM_NODE_ATTRIBUTES, NUM_NODE_TYPES, _random_dfs_tree, code2_node_counts

    raws = []
    for graph_id, num_nodes in enumerate(code2_node_counts(n, int(rng.integers(1 << 31))).tolist()):
        parents = _random_dfs_tree(num_nodes, rng)
        depth = np.zeros(num_nodes, dtype=np.int64)
        for child, parent in enumerate(parents.tolist(), start=1):
            depth[child] = depth[parent] + 1
        attributed = np.ones(num_nodes, dtype=np.int64)
        attributed[parents] = 0
        x = np.stack([rng.integers(0, NUM_NODE_TYPES, num_nodes), rng.integers(0, NUM_NODE_ATTRIBUTES, num_nodes)], 1)
        tokens = [f"tok{int(t)}" for t in rng.integers(0, 40, int(rng.integers(1, 4)))]
        raws.append({"graph_id": graph_id, "num_nodes": num_nodes, "x": x, "node_depth": depth,
                     "node_is_attributed": attributed, "y_tokens": tokens,
                     "edge_index": np.stack([parents, np.arange(1, num_nodes)])})
    return raws


def _ppa_raws(n: int, rng: np.random.Generator) -> list[dict]:
    from preprocessing.synthetic import NUM_CLASSES, class_prototypes, synthetic_ppa_graph

    prototypes = class_prototypes(0)
    raws = []
    for graph_id, label in enumerate(rng.integers(0, NUM_CLASSES, size=n).tolist()):
        pairs, feats, num_nodes = synthetic_ppa_graph(rng, label, prototypes)
        raws.append({"graph_id": graph_id, "num_nodes": num_nodes, "y": label,
                     "edge_index": np.stack([pairs, pairs[:, ::-1]], axis=1).reshape(-1, 2).T,
                     "edge_attr": np.repeat(feats, 2, axis=0)})
    return raws


def _sbm_raws(name: str, n: int, seed: int) -> list[dict]:
    from preprocessing.sbm import generate

    graphs, _splits, _instances = generate(name, graphs=max(n, 3), seed=seed)
    return [{"graph_id": i, "num_nodes": g.x.size, "x": g.x.astype(np.int64), "node_label": g.y.astype(np.int64),
             "edge_index": np.concatenate([g.edges.T, g.edges.T[::-1]], axis=1).astype(np.int64)}
            for i, g in enumerate(graphs[:n])]


def _raws(job: JobConfig, task_name: str, n: int, seed: int) -> tuple[list[dict], list[str] | None]:
    """``n`` raw graphs of the job's task and, for code2, the job's full vocabulary (its head's size),
    of which the graphs use a few."""
    from pipeline.tasks import EOS, UNK

    rng = np.random.default_rng(seed)
    if task_name == "code2":
        return _code2_raws(n, rng), [f"tok{i}" for i in range(job.transform.vocab_size)] + [UNK, EOS]
    if task_name == "ppa":
        return _ppa_raws(n, rng), None
    return _sbm_raws(task_name, n, seed), None


def job_graphs(job: JobConfig, n: int, seed: int = 0) -> tuple[list[SATData], Task, SATConfig]:
    """``n`` graphs laid out as ``job``'s shards hold them, the job's task and its model config."""
    task_name = task_name_for(job.train.task, job.data.name)
    raws, vocab = _raws(job, task_name, n, seed)
    task = make_task(task_name, vocab=vocab, **({"max_seq_len": job.transform.max_seq_len} if vocab else {}))
    graphs = featurise(raws, task_name, job.transform, vocab)
    config = task.configure(job.model, graphs[0])
    if config.gnn_type == "pna" and not config.pna_degree_histogram:
        degrees = np.concatenate([np.bincount(g.edge_index[1].numpy(), minlength=g.num_nodes) for g in graphs])
        config = dataclasses.replace(config, pna_degree_histogram=np.bincount(degrees).tolist())
    return graphs, task, config


def job_shards(job: JobConfig, out: str | Path, graphs: int, eval_graphs: int | None = None, seed: int = 0) -> Path:
    """A shard directory in ``out`` of ``job``'s task and transform: ``graphs`` train graphs, ``eval_graphs``
    (default a tenth, at least 4) in each of valid and test; one shard per split, the vocabulary and the
    manifest as :func:`preprocessing.build.build_shards` writes them (the manifest last). Made once: a
    directory with a manifest is reused."""
    import hashlib
    import json

    from preprocessing.shard_places import sha256_file
    from preprocessing.shards import MANIFEST, SCHEMA_VERSION, VOCAB_FILE, column_specs, encode_shard, json_bytes
    from preprocessing.transforms import transform_graph

    out = Path(out)
    if (out / MANIFEST).is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    task_name = task_name_for(job.train.task, job.data.name)
    specs = column_specs(task_name, job.transform)
    eval_graphs = eval_graphs or max(4, graphs // 10)
    manifest: dict = {"schema_version": SCHEMA_VERSION, "dataset": job.data.name, "task": task_name, "columns": specs,
                      "splits": {}, "shards": [], "vocab_file": None, "vocab_sha256": None,
                      "max_seq_len": job.transform.max_seq_len if task_name == "code2" else None}
    for index, (split, n) in enumerate((("train", graphs), ("valid", eval_graphs), ("test", eval_graphs))):
        raws, vocab = _raws(job, task_name, n, seed + index)
        vocab_index = {w: i for i, w in enumerate(vocab)} if vocab else None
        path = out / f"{split}-00000.arrow"
        path.write_bytes(encode_shard([transform_graph(r, task_name, job.transform, vocab_index) for r in raws], specs))
        manifest["splits"][split] = {"graphs": n, "nodes": int(sum(r["num_nodes"] for r in raws)), "shards": [path.name]}
        manifest["shards"].append({"file": path.name, "split": split, "rows": n, "bytes": path.stat().st_size,
                                   "sha256": sha256_file(path)})
    if vocab:
        payload = (json.dumps(vocab) + "\n").encode()
        (out / VOCAB_FILE).write_bytes(payload)
        manifest.update(vocab_file=VOCAB_FILE, vocab_sha256=hashlib.sha256(payload).hexdigest(), num_vocab=len(vocab))
    (out / f".{MANIFEST}.tmp").write_bytes(json_bytes(manifest))
    (out / f".{MANIFEST}.tmp").rename(out / MANIFEST)
    return out
