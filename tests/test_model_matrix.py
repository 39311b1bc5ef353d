"""Every extractor x GNN type x readout x PE combination builds, runs forward and backward, with and
without edge attributes, and every trainable parameter receives a non-zero gradient."""
import functools
import itertools

import pytest
import torch
from torch_geometric.data import Batch

from sat import SAT, SATConfig, SATData, add_subgraph_indices, incident_edge_sum, laplacian_pe, random_walk_pe

PNA_HIST = [1, 4, 6, 3, 1]


def _batch(edge_attr: bool, seed=0, k=2, sizes=(5, 8, 3)):
    gen = torch.Generator().manual_seed(seed)
    graphs = []
    for n in sizes:
        ei = torch.randint(0, n, (2, 2 * n), generator=gen)
        ei = torch.cat([ei, ei.flip(0)], dim=1)
        data = SATData(
            x=torch.randint(0, 5, (n, 1), generator=gen),
            edge_index=ei,
            rwpe=random_walk_pe(ei, n, 3),
            lap_pe=laplacian_pe(ei, n, 3),
            y=torch.randint(0, 3, (1,), generator=gen),
        )
        if edge_attr:
            data.edge_attr = torch.rand(ei.size(1), 4, generator=gen)
        graphs.append(add_subgraph_indices(data, k))
    return Batch.from_data_list(graphs)


@functools.lru_cache(maxsize=None)
def _shared_batch(edge_attr: bool):
    return _batch(edge_attr)  # read-only in the matrix test


def _check_all_grads(model):
    bad = [name for name, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.abs().sum() > 0)]
    assert not bad, f"parameters without gradient: {bad}"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


COMBOS = list(
    itertools.product(
        ["subtree", "subgraph"], ["gcn", "gin", "gine", "sage", "pna"], ["mean", "sum", "cls"], ["none", "rwpe", "lap"]
    )
)


@pytest.mark.parametrize("edge_attr", [True, False], ids=["edges", "noedges"])
@pytest.mark.parametrize("extractor,gnn,readout,pe", COMBOS, ids=["-".join(c) for c in COMBOS])
def test_combination_trains(extractor, gnn, readout, pe, edge_attr):
    cfg = SATConfig(
        hidden_dim=8, num_heads=2, num_layers=1, dropout=0.1, node_in_dim=5, extractor=extractor, k_hops=2,
        gnn_type=gnn, readout=readout, pe=pe, pe_dim=3 if pe != "none" else 0,
        edge_encoder="linear" if edge_attr else "none", edge_in_dim=4 if edge_attr else 0, edge_dim=6,
        pna_degree_histogram=PNA_HIST if gnn == "pna" else None, num_classes=3,
    )
    torch.manual_seed(0)
    model = SAT(cfg).train()
    batch = _shared_batch(edge_attr)
    out = model(batch)
    assert out.shape == (3, 3)
    torch.nn.functional.cross_entropy(out, batch.y).backward()
    _check_all_grads(model)


VARIANTS = {
    "k0-transformer": dict(k_hops=0),
    "k0-cls-lap": dict(k_hops=0, readout="cls", pe="lap", pe_dim=3),
    "k1-concat-gcn-edges": dict(k_hops=1, concat_hops=True, edge_encoder="linear", edge_in_dim=4),
    "k3-concat-subgraph-pna": dict(k_hops=3, concat_hops=True, extractor="subgraph", gnn_type="pna",
                                   pna_degree_histogram=PNA_HIST, edge_encoder="linear", edge_in_dim=4),
    "layernorm-prenorm-sparse": dict(norm="layer", pre_norm=True, attention="sparse", attn_dropout=0.2),
    "batchnorm-prenorm": dict(pre_norm=True),
    "no-degree-scaling": dict(degree_scaling=False),
    "regression-head": dict(head="graph_regression", num_classes=2),
    "node-head-cls": dict(head="node_classification", readout="cls", extractor="subgraph"),
    "node-head-mean": dict(head="node_classification"),
    "edge-embedding": dict(gnn_type="gine", edge_encoder="embedding", edge_in_dim=3, edge_in_columns=2),
    "edge-sum-nodes": dict(node_encoder="edge_sum", node_in_dim=4, edge_encoder="linear", edge_in_dim=4),
    "linear-nodes": dict(node_encoder="linear", node_in_dim=3),
    "constant-nodes": dict(node_encoder="constant"),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_trains(name):
    kw = dict(hidden_dim=8, num_heads=2, num_layers=2, node_in_dim=5, num_classes=3)
    kw.update(VARIANTS[name])
    cfg = SATConfig(**kw)
    torch.manual_seed(0)
    model = SAT(cfg).train()
    batch = _batch(edge_attr=True, k=max(cfg.k_hops, 1))
    if cfg.node_encoder == "linear":
        batch.x = torch.rand(batch.num_nodes, 3)
    if cfg.edge_encoder == "embedding":
        batch.edge_attr = torch.randint(0, 3, (batch.edge_index.size(1), 2))
    out = model(batch)
    if cfg.head == "node_classification":
        assert out.shape == (batch.num_nodes, 3)
        loss = out.pow(2).mean()
    else:
        assert out.shape == (3, cfg.num_classes)
        loss = (out * torch.randn_like(out)).sum()
    loss.backward()
    _check_all_grads(model)


def _code2_batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    graphs = []
    for n in (6, 11):
        parent = torch.tensor([torch.randint(0, i, (1,), generator=gen).item() for i in range(1, n)])
        child = torch.arange(1, n)
        ast = torch.stack([parent, child])
        ei = torch.cat([ast, ast.flip(0)], dim=1)
        ea = torch.cat([torch.zeros(n - 1, 2), torch.tensor([[0, 1]]).repeat(n - 1, 1)]).long()
        depth = torch.zeros(n, dtype=torch.long)
        for c, p in zip(child.tolist(), parent.tolist()):
            depth[c] = depth[p] + 1
        graphs.append(
            SATData(
                x=torch.stack([torch.randint(0, 98, (n,), generator=gen), torch.randint(0, 10030, (n,), generator=gen)], 1),
                edge_index=ei, edge_attr=ea, node_depth=depth, y=torch.randint(0, 12, (1, 5), generator=gen),
            )
        )
    return Batch.from_data_list(graphs)


@pytest.mark.parametrize("edge_encoder", ["linear", "embedding"])
def test_code2_configuration(edge_encoder):
    edge = dict(edge_in_dim=2) if edge_encoder == "linear" else dict(edge_in_dim=2, edge_in_columns=2)
    cfg = SATConfig(
        hidden_dim=16, num_heads=4, num_layers=2, node_encoder="code2_ast", edge_encoder=edge_encoder, edge_dim=8,
        code2_max_depth=3, head="code2_sequence", num_classes=12, max_seq_len=5, **edge,
    )
    torch.manual_seed(0)
    model = SAT(cfg).train()
    batch = _code2_batch()
    out = model(batch)
    assert out.shape == (2, 5, 12)
    torch.nn.functional.cross_entropy(out.reshape(-1, 12), batch.y.reshape(-1)).backward()
    bad = [n for n, p in model.named_parameters() if p.grad is None]
    assert not bad


def test_ppa_edge_sum_precomputed_matches_edge_sum_encoder():
    """ppa: node features as precomputed incident edge sums (linear, width 7) == the edge_sum encoder."""
    batch = _batch(edge_attr=True)
    kw = dict(hidden_dim=8, num_heads=2, num_layers=1, node_in_dim=4, edge_encoder="linear", edge_in_dim=4)
    torch.manual_seed(0)
    a = SAT(SATConfig(node_encoder="edge_sum", **kw)).eval()
    b = SAT(SATConfig(node_encoder="linear", **kw)).eval()
    b.load_state_dict(a.state_dict())
    pre = batch.clone()
    pre.x = incident_edge_sum(batch.edge_index, batch.edge_attr, batch.num_nodes)
    torch.testing.assert_close(a(batch), b(pre))


def test_laplacian_pe_sign_flip_only_in_training():
    cfg = SATConfig(hidden_dim=8, num_heads=2, num_layers=1, node_in_dim=5, pe="lap", pe_dim=3, dropout=0.0, norm="layer")
    torch.manual_seed(0)
    model = SAT(cfg)
    batch = _batch(edge_attr=False)
    model.eval()
    torch.testing.assert_close(model(batch), model(batch))
    model.train()
    outs = [model(batch) for _ in range(6)]
    assert any(not torch.allclose(outs[0], o) for o in outs[1:])  # random signs per graph and eigenvector


@pytest.mark.parametrize("gnn", ["gcn", "gine", "pna", "sage"])
def test_subgraph_stack_deferred_gathers_match_gathered_inputs(gnn):
    """The k-subgraph extractor maps nodes/edges before gathering them per subgraph entry where
    the GNN allows it; the result equals running the GNN on the gathered inputs."""
    from sat.extractors import _GNNStack

    batch = _shared_batch(True)
    torch.manual_seed(0)
    stack = _GNNStack(8, gnn, 2, 4 if gnn != "sage" else None, True, PNA_HIST)
    x = torch.randn(batch.num_nodes, 8)
    ea = torch.rand(batch.edge_index.size(1), 4)
    sni, seid = batch.subgraph_node_index, batch.subgraph_edge_id
    deferred = stack(x, batch.subgraph_edge_index, ea, node_index=sni, edge_id=seid)
    eager = stack(x[sni], batch.subgraph_edge_index, ea[seid])
    torch.testing.assert_close(deferred, eager, atol=1e-5, rtol=1e-4)
