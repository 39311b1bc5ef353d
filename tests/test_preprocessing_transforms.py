"""Per-graph transforms against the references they reimplement (OGB's code2 example, sat.encodings)."""
from __future__ import annotations

import numpy as np
import torch

from preprocessing.config import TransformConfig
from preprocessing.transforms import EOS, UNK, augment_edge, build_vocab, encode_targets, transform_graph
from sat.data import k_hop_subgraph_indices


def _ogb_augment_edge(edge_index: torch.Tensor, node_is_attributed: torch.Tensor):
    """OGB examples/graphproppred/code2/utils.py ``augment_edge`` (float attributes)."""
    edge_attr_ast = torch.zeros((edge_index.size(1), 2))
    inverse = torch.stack([edge_index[1], edge_index[0]], dim=0)
    attr_inverse = torch.cat([torch.zeros(inverse.size(1), 1), torch.ones(inverse.size(1), 1)], dim=1)
    attributed = torch.where(node_is_attributed.view(-1) == 1)[0]
    nxt = torch.stack([attributed[:-1], attributed[1:]], dim=0)
    attr_nxt = torch.cat([torch.ones(nxt.size(1), 1), torch.zeros(nxt.size(1), 1)], dim=1)
    nxt_inverse = torch.stack([nxt[1], nxt[0]], dim=0)
    attr_nxt_inverse = torch.ones((nxt.size(1), 2))
    return (
        torch.cat([edge_index, inverse, nxt, nxt_inverse], dim=1),
        torch.cat([edge_attr_ast, attr_inverse, attr_nxt, attr_nxt_inverse], dim=0),
    )


def _ogb_vocab(seqs, num_vocab):
    """OGB's ``get_vocab_mapping`` (with the vocabulary size clamped)."""
    cnt, order = {}, []
    for seq in seqs:
        for w in seq:
            if w not in cnt:
                cnt[w] = 0
                order.append(w)
            cnt[w] += 1
    counts = np.array([cnt[w] for w in order])
    top = np.argsort(-counts, kind="stable")[:num_vocab]
    return [order[i] for i in top] + ["__UNK__", "__EOS__"]


def _tree(n, seed):
    rng = np.random.default_rng(seed)
    parent = (rng.random(n - 1) * np.arange(1, n)).astype(np.int64)
    return np.stack([parent, np.arange(1, n)]), (rng.random(n) < 0.55).astype(np.int64)


def test_augment_edge_matches_ogb():
    ei, att = _tree(40, 0)
    mine_ei, mine_attr = augment_edge(ei, att)
    ref_ei, ref_attr = _ogb_augment_edge(torch.from_numpy(ei), torch.from_numpy(att).view(-1, 1))
    assert np.array_equal(mine_ei, ref_ei.numpy())
    assert np.array_equal(mine_attr, ref_attr.long().numpy())


def test_vocab_and_targets_match_ogb():
    rng = np.random.default_rng(1)
    seqs = [[f"w{int(t)}" for t in rng.zipf(1.5, size=rng.integers(1, 8)) % 50] for _ in range(300)]
    for size in (5, 20, 5000):  # 5000 > distinct subtokens: clamped
        vocab = build_vocab(seqs, size)
        assert vocab == _ogb_vocab(seqs, size)
        assert vocab[-2:] == [UNK, EOS]
    vocab = build_vocab(seqs, 5)
    index = {w: i for i, w in enumerate(vocab)}
    y = encode_targets([vocab[0], "never-seen", vocab[1]], index, 5)
    assert y.tolist() == [0, index[UNK], 1, index[EOS], index[EOS]]
    assert encode_targets([vocab[0]] * 9, index, 5).tolist() == [0] * 5


def _raw_code2(n=50, seed=3):
    ei, att = _tree(n, seed)
    rng = np.random.default_rng(seed)
    return {
        "graph_id": 7,
        "num_nodes": n,
        "edge_index": ei,
        "x": np.stack([rng.integers(0, 98, n), rng.integers(0, 10030, n)], axis=1),
        "node_depth": rng.integers(0, 9, n),
        "node_is_attributed": att,
        "y_tokens": ["get", "value", "zzz"],
    }


def test_transform_graph_code2_columns():
    cfg = TransformConfig(rwpe_steps=8, lap_pe_dim=3, k_hops=2)
    vocab = ["get", "value", UNK, EOS]
    out = transform_graph(_raw_code2(), "code2", cfg, {w: i for i, w in enumerate(vocab)})
    n, e = 50, out["edge_index"].shape[1]
    assert out["edge_attr"].shape == (e, 2) and out["x"].shape == (n, 2)
    assert out["rwpe"].shape == (n, 8) and out["lap_pe"].shape == (n, 3) and out["degree"].shape == (n,)
    assert (out["degree"] >= 1).all()
    assert out["y"].tolist() == [0, 1, 2, 3, 3] and out["y_tokens"] == ["get", "value", "zzz"]
    sub = k_hop_subgraph_indices(torch.from_numpy(out["edge_index"]), n, 2)
    assert np.array_equal(np.repeat(np.arange(n), out["subgraph_size"]), sub["subgraph_indicator"].numpy())
    assert np.array_equal(out["subgraph_edge_index"], sub["subgraph_edge_index"].numpy())


def test_transform_graph_ppa_node_inputs():
    rng = np.random.default_rng(0)
    ei = np.array([[0, 1, 1, 2], [1, 0, 2, 1]])
    attr = rng.random((4, 7)).astype(np.float32)
    raw = {"graph_id": 0, "num_nodes": 4, "edge_index": ei, "edge_attr": attr, "y": 5}
    zeros = transform_graph(raw, "ppa", TransformConfig(k_hops=1, rwpe_steps=0))
    assert zeros["x"].shape == (4, 1) and zeros["x"].sum() == 0 and zeros["y"].tolist() == [5]
    summed = transform_graph(raw, "ppa", TransformConfig(k_hops=0, rwpe_steps=4, ppa_node_input="edge_sum"))
    np.testing.assert_allclose(summed["x"][1], attr[0] + attr[3], rtol=1e-6)
    assert (summed["x"][3] == 0).all() and "subgraph_node_index" not in summed


def test_khop_indices_on_graphs_without_edges():
    out = k_hop_subgraph_indices(torch.zeros(2, 0, dtype=torch.long), 3, 2)
    assert out["subgraph_node_index"].tolist() == [0, 1, 2] and out["subgraph_indicator"].tolist() == [0, 1, 2]
    assert out["subgraph_edge_index"].shape == (2, 0) and out["subgraph_edge_id"].numel() == 0


def test_featurise_new_source_like_training_data():
    import ast as pyast

    from preprocessing.reader import featurise
    from preprocessing.python_graphs import code_to_raw_graph

    fn = pyast.parse("def parse_value(text):\n    return int(text.strip())\n").body[0]
    types = {t: i for i, t in enumerate(["Module", "FunctionDef", "Name", "Load", "__UNK__"])}
    attrs = {a: i for i, a in enumerate(["_mask_", "text", "__UNK__", "__NONE__"])}
    raw = code_to_raw_graph(fn, types, attrs)
    assert raw["y_tokens"] == ["parse", "value"]
    (g,) = featurise([raw], "code2", TransformConfig(rwpe_steps=4, k_hops=1), ["parse", UNK, EOS])
    assert g.x.shape == (raw["num_nodes"], 2) and g.x[1].tolist() == [1, 0]  # FunctionDef, masked name
    assert g.y.tolist() == [[0, 1, 2, 2, 2]] and g.rwpe.shape == (raw["num_nodes"], 4) and "subgraph_node_index" in g
