"""The training loader's batch path: ``ShardDataset.batch`` decodes a whole batch of rows straight into
one PyG ``Batch`` equal to ``Batch.from_data_list`` of the items (every column kind: code2 with
``y_tokens``, k-hop subgraph columns and int8 edge features; ppa with float ``x`` and ``edge_attr``;
PATTERN's int8 node inputs and per-node labels), the loader ships it packed and yields it checked and
laid out, and the node-budget batches flow from one epoch into the next.

Shards are written here directly (transform, Arrow encoding, manifest), two per split, small: no Ray.
"""
from __future__ import annotations

import dataclasses
import io
import json
import pickle
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
from torch_geometric.data import Batch

from pipeline.train.batching import NodeBudgetSampler, pack
from pipeline.train.global_batch import GlobalBatches, Position, RankStream
from pipeline.train.loader import BatchCollator, PackedBatch, make_loader, to_device
from pipeline.tasks import make_task
from preprocessing.config import TransformConfig
from preprocessing.reader import ShardDataset
from preprocessing.shard_places import sha256_file
from preprocessing.shards import MANIFEST, SCHEMA_VERSION, column_specs, encode_shard
from preprocessing.transforms import transform_graph
from sat import GraphLayout, SATConfig

TRANSFORMS = {
    "code2": TransformConfig(rwpe_steps=4, lap_pe_dim=2, k_hops=2, max_seq_len=5),
    "ppa": TransformConfig(rwpe_steps=0, k_hops=1, ppa_node_input="edge_sum"),
    "pattern": TransformConfig(rwpe_steps=3, k_hops=0),
}
WORDS = ["get", "set", "name", "value", "read", "write"]


def _raw_graph(task: str, gid: int, rng: np.random.Generator) -> dict:
    """A small random raw graph of ``task`` (graph 0 has one node and no edge)."""
    n = 1 if gid == 0 else int(rng.integers(2, 30))
    raw = {"graph_id": gid, "num_nodes": n}
    if task == "code2":  # an AST-like tree, parent -> child
        parents = np.array([rng.integers(0, c) for c in range(1, n)], dtype=np.int64)
        raw["edge_index"] = np.stack([parents, np.arange(1, n)]).reshape(2, -1)
        depth = np.zeros(n, dtype=np.int64)
        for c, p in zip(range(1, n), parents.tolist()):
            depth[c] = depth[p] + 1
        leaf = np.ones(n, dtype=np.int64)
        leaf[parents] = 0
        raw.update(x=np.stack([rng.integers(0, 98, n), rng.integers(0, 10030, n)], axis=1), node_depth=depth,
                   node_is_attributed=leaf, y_tokens=list(rng.choice(WORDS + ["rare"], int(rng.integers(0, 7)))))
    else:
        edges = rng.integers(0, n, size=(2, int(rng.integers(0, 3 * n)))) if n > 1 else np.zeros((2, 0), np.int64)
        raw["edge_index"] = np.concatenate([edges, edges[::-1]], axis=1)
        if task == "ppa":
            raw.update(edge_attr=rng.random((raw["edge_index"].shape[1], 7), dtype=np.float32), y=int(rng.integers(0, 37)))
        else:
            raw.update(x=rng.integers(0, 3, n), node_label=rng.integers(0, 2, n))
    return raw


def _write_shards(out, task: str, graphs: int = 23, per_shard: int = 10, split: str = "train"):
    """A shard directory of ``task`` (its ``split`` only) in the layout of ``preprocessing.shards``."""
    rng = np.random.default_rng(sum(map(ord, task)))
    transform = TRANSFORMS[task]
    vocab = WORDS + ["__UNK__", "__EOS__"] if task == "code2" else None
    index = {w: i for i, w in enumerate(vocab)} if vocab else None
    rows = [transform_graph(_raw_graph(task, g, rng), task, transform, index) for g in range(graphs)]
    specs = column_specs(task, transform)
    out.mkdir(parents=True)
    entries = []
    for k, lo in enumerate(range(0, graphs, per_shard)):
        path = out / f"{split}-{k:05d}.arrow"
        path.write_bytes(encode_shard(rows[lo:lo + per_shard], specs))
        entries.append({"file": path.name, "split": split, "rows": len(rows[lo:lo + per_shard]),
                        "bytes": path.stat().st_size, "sha256": sha256_file(path)})
    manifest = {"schema_version": SCHEMA_VERSION, "dataset": task, "task": task, "columns": specs,
                "splits": {split: {"graphs": graphs, "shards": [e["file"] for e in entries]}}, "shards": entries}
    if vocab:
        (out / "vocab.json").write_text(json.dumps(vocab))
        manifest["vocab_file"] = "vocab.json"
    (out / MANIFEST).write_text(json.dumps(manifest))
    return ShardDataset(out, split)


@pytest.fixture(scope="module", params=sorted(TRANSFORMS))
def shards(request, tmp_path_factory):
    return _write_shards(tmp_path_factory.mktemp("loader") / request.param, request.param)


def _assert_equal(got, want) -> None:
    """Equal PyG batches: class, attributes (dtype, shape, values; a layout's index tensors), graphs,
    slice and increment dicts."""
    assert type(got) is type(want)
    assert sorted(got.keys()) == sorted(want.keys())
    for key in want.keys():
        a, b = got[key], want[key]
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), key
        elif isinstance(b, GraphLayout):
            assert (a.num_graphs, a.num_nodes, a.max_nodes) == (b.num_graphs, b.num_nodes, b.max_nodes)
            for name in ("batch", "ptr", "cu_seqlens", "local_index"):
                assert torch.equal(getattr(a, name), getattr(b, name)), name
            assert [(G, L) for *_, G, L in a.dense_groups()] == [(G, L) for *_, G, L in b.dense_groups()]
        else:
            assert a == b, key
    assert got.num_graphs == want.num_graphs
    for name in ("_slice_dict", "_inc_dict"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.keys() == b.keys(), name
        for key in b:
            assert (a[key] is None and b[key] is None) or (a[key].dtype == b[key].dtype and torch.equal(a[key], b[key])), (name, key)


@pytest.mark.parametrize("ids", [[0], [3, 0, 22, 11, 12, 5], [-1, 9, 10, 19, 20], list(range(23))[::-1]])
def test_batch_equals_pyg_collation_of_the_items(shards, ids):
    _assert_equal(shards.batch(np.array(ids)), Batch.from_data_list([shards[i] for i in ids]))


def test_batch_has_every_column_kind(shards):
    batch = shards.batch(np.arange(len(shards)))
    task = shards.manifest["task"]
    expected = {"code2": {"y_tokens", "edge_attr", "node_depth", "subgraph_indicator", "subgraph_edge_id", "lap_pe"},
                "ppa": {"edge_attr", "subgraph_edge_index"}, "pattern": {"rwpe"}}[task]
    assert expected <= set(batch.keys())
    assert batch.x.dtype == (torch.float32 if task == "ppa" else torch.long)
    if task == "code2":  # subgraph edges still join the right nodes once offset over the batch
        ends = batch.subgraph_node_index[batch.subgraph_edge_index]
        assert torch.equal(ends, batch.edge_index[:, batch.subgraph_edge_id])


def test_batch_rejects_bad_indices(shards):
    with pytest.raises(IndexError, match="index 23 out of range"):
        shards.batch([0, 23])
    with pytest.raises(ValueError, match="at least one"):
        shards.batch([])


def _collator(ds: ShardDataset, **kw) -> BatchCollator:
    task = ds.manifest["task"]
    config = SATConfig(hidden_dim=8, num_heads=2, num_layers=1, extractor="subgraph" if task == "code2" else "subtree", **kw)
    return BatchCollator(make_task(task, vocab=ds.vocab).configure(config, ds[1]))


@pytest.mark.parametrize("workers", [0, 1])
def test_loader_yields_each_batch_checked_with_its_layout(shards, workers):
    collator = _collator(shards)
    sampler = NodeBudgetSampler(shards.num_nodes, 120, seed=1, bucket_size=8)
    loader = make_loader(shards, sampler, collator, workers=workers, pin_memory=False)
    batches = list(loader)
    assert len(batches) == len(sampler.epoch_batches())
    for got, ids in zip(batches, sampler.epoch_batches()):
        want = collator(Batch.from_data_list([shards[int(i)] for i in ids]))
        _assert_equal(got, want)
    assert sorted(np.concatenate([b.graph_id.numpy() for b in batches]).tolist()) == list(range(len(shards)))


def test_loader_names_a_bad_value_in_one_line(shards):
    if shards.manifest["task"] == "ppa":
        pytest.skip("float node inputs carry no ids to check")
    collator = _collator(shards)
    collator.config = type(collator.config)(**{**collator.config.__dict__, "node_in_dim": 1,
                                               "code2_num_node_types": 1})
    loader = make_loader(shards, NodeBudgetSampler(shards.num_nodes, 400, seed=0), collator, workers=0, pin_memory=False)
    with pytest.raises(ValueError, match=r"^x(\[:, 0\])? holds (node type )?ids outside [^\n]*$"):
        next(iter(loader))


def test_packed_batch_crosses_processes_as_one_buffer(shards):
    batch = _collator(shards)(shards.batch(np.arange(len(shards))))
    packed = PackedBatch(batch)
    stream = io.BytesIO()
    ForkingPickler(stream, pickle.HIGHEST_PROTOCOL).dump(packed)  # as a DataLoader worker sends it
    back = pickle.loads(stream.getvalue()).unpack()
    _assert_equal(back, batch)
    storages = {t.untyped_storage().data_ptr() for _, t in back if isinstance(t, torch.Tensor)}
    assert storages == {packed.buffer.untyped_storage().data_ptr()}  # views of the one buffer


def test_rank_stream_runs_on_into_the_next_epochs_from_its_position():
    sizes = np.random.default_rng(0).integers(5, 60, 300)
    batches = GlobalBatches(NodeBudgetSampler(sizes, 400, seed=2), micro_batches_per_step=3)
    stream = iter(RankStream(batches, rank=1, world=2, start=Position(3, 2)))
    steps = batches.steps_per_epoch
    taken = [next(stream) for _ in range(3 * steps - 2)]  # rank 1 of 2 takes micro-batch 1 of each step's 3
    expected = [batches.step(epoch, s)[1] for epoch in (3, 4, 5) for s in range(steps) if (epoch, s) >= (3, 2)]
    assert len(taken) == len(expected) and all(np.array_equal(a, b) for a, b in zip(taken, expected))


def test_pack_is_the_greedy_cut_of_sorted_graphs():
    rng = np.random.default_rng(0)
    for _ in range(50):
        sizes = rng.integers(0, 300, int(rng.integers(1, 200)))
        order = np.argsort(sizes, kind="stable")
        budget, max_graphs = int(rng.integers(1, 2000)), [None, int(rng.integers(1, 20))][int(rng.integers(0, 2))]
        batches = pack(order, sizes, budget, max_graphs)
        assert np.array_equal(np.concatenate(batches), order)
        for b, following in zip(batches, batches[1:] + [None]):
            fits = len(b) * sizes[b].max() <= budget and (max_graphs is None or len(b) <= max_graphs)
            assert fits or len(b) == 1
            if following is not None:  # greedy: the next graph would not have fitted
                grown = np.append(b, following[0])
                assert len(grown) * sizes[grown].max() > budget or (max_graphs is not None and len(grown) > max_graphs)
    with pytest.raises(ValueError, match="sorted by size"):
        pack(np.array([1, 0]), np.array([5, 9]), 100)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs CUDA")
def test_pinned_batch_reaches_the_device_equal(shards):
    batch = _collator(shards)(shards.batch(np.arange(len(shards))))
    pinned = PackedBatch(batch).pin_memory().unpack()
    assert all(t.is_pinned() for _, t in pinned if isinstance(t, torch.Tensor)) and pinned.graph_layout.ptr.is_pinned()
    on_device = to_device(pinned, torch.device("cuda"))
    for key, value in batch:
        if isinstance(value, torch.Tensor):
            assert torch.equal(on_device[key].cpu(), value), key


def test_shard_sizes_are_the_items_sizes(shards):
    """``ShardDataset.sizes``: every item's edges and k-subgraph entries/edges from the offsets alone."""
    items = [shards[i] for i in range(len(shards))]
    assert shards.sizes("num_nodes").tolist() == [g.num_nodes for g in items]
    assert shards.sizes("edge_index").tolist() == [g.edge_index.size(1) for g in items]
    if "subgraph_node_index" in shards.manifest["columns"]:
        assert shards.sizes("subgraph_node_index").tolist() == [g.subgraph_node_index.numel() for g in items]
        assert shards.sizes("subgraph_edge_index").tolist() == [g.subgraph_edge_index.size(1) for g in items]
    with pytest.raises(ValueError, match="no tensor column 'nope'"):
        shards.sizes("nope")


def test_loader_pads_the_batches_that_fit_its_capacity(shards):
    """With a capacity (``train.step`` static, compiled, captured) the loader pads every batch that fits
    to the same shapes and leaves the others (over the capacity: run eagerly) as they come."""
    from pipeline.train.capacity import batch_totals, capacity_for, graph_sizes, share_over
    from pipeline.train.cuda_graphs import batch_tensors
    from sat.padding import fits, padding_of

    plain = _collator(shards)
    sampler = NodeBudgetSampler(shards.num_nodes, 120, seed=1, bucket_size=8)
    sizes = graph_sizes(shards, subgraphs=plain.config.needs_subgraphs)
    roomy = capacity_for(batch_totals(sampler.global_batches(0), sizes), sigmas=5.0)  # every batch fits...
    median_nodes = int(np.median([shards.num_nodes[b].sum() for b in sampler.global_batches(0)]))
    capacity = dataclasses.replace(roomy, nodes=median_nodes + 1)  # ...but those over the median node count
    collator = BatchCollator(plain.config, capacity=capacity, node_targets=shards.manifest["task"] == "pattern")
    batches = list(make_loader(shards, sampler, collator, workers=0, pin_memory=False))
    padded = [b for b in batches if padding_of(b) is not None]
    over = [b for b in batches if padding_of(b) is None]
    assert padded and over and len(over) == round(share_over(batch_totals(sampler.epoch_batches(), sizes), capacity) * len(batches))
    assert all(not fits(b, capacity) and b.graph_layout.node_mask is None for b in over)
    shapes = {tuple((tuple(t.shape), t.dtype) for t in batch_tensors(b)) for b in padded}
    assert len(shapes) == 1 and padded[0].num_nodes == capacity.nodes
    assert sum(padding_of(b).graphs for b in padded) + sum(b.num_graphs for b in over) == len(shards)
