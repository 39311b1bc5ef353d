"""The paper's baselines as settings of one model (Chen et al., ICML 2022, Tables 1 and 4): the base GNN
alone (``architecture: gnn``), the Transformer with RWPE (``k_hops: 0``), k-subtree and k-subgraph SAT.
They build, run and train, and the base GNN is the same GNN stack as SAT's extractors."""
from __future__ import annotations

import pytest
import torch
from torch_geometric.data import Batch

from sat import SAT, SATConfig, SATData, add_subgraph_indices, random_walk_pe
from sat.layers import GNNLayer, SATLayer

BASELINES = {
    "gnn": dict(architecture="gnn"),
    "transformer_rwpe": dict(k_hops=0, pe="rwpe", pe_dim=4),
    "subtree": dict(extractor="subtree", k_hops=2, pe="rwpe", pe_dim=4),
    "subgraph": dict(extractor="subgraph", k_hops=1, pe="rwpe", pe_dim=4),
}


def _graphs(count=6, seed=0):
    """Two-community graphs: label = community, node input 1 + community on one node each, else 0
    (a tiny CLUSTER)."""
    gen = torch.Generator().manual_seed(seed)
    graphs = []
    for _ in range(count):
        sizes = torch.randint(4, 8, (2,), generator=gen).tolist()
        y = torch.cat([torch.full((s,), c) for c, s in enumerate(sizes)])
        n = len(y)
        same = y[:, None] == y[None, :]
        adj = torch.rand(n, n, generator=gen) < torch.where(same, torch.tensor(0.7), torch.tensor(0.1))
        adj = torch.triu(adj, 1)
        ei = adj.nonzero().t()
        ei = torch.cat([ei, ei.flip(0)], 1)
        x = torch.zeros(n, 1, dtype=torch.long)
        x[0, 0], x[sizes[0], 0] = 1, 2
        graphs.append(add_subgraph_indices(SATData(x=x, edge_index=ei, rwpe=random_walk_pe(ei, n, 4), y=y), 1))
    return Batch.from_data_list(graphs)


def _config(name: str, **extra) -> SATConfig:
    values = dict(hidden_dim=16, num_layers=2, num_heads=4, dropout=0.0, node_in_dim=3, gnn_type="gcn",
                  head="node_classification", num_classes=2)
    values.update(BASELINES[name])
    values.update(extra)
    return SATConfig(**values)


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_baselines_build_run_and_train(name):
    """Each baseline runs forward and backward, and fits a fixed batch (the loss falls by half)."""
    torch.manual_seed(0)
    batch = _graphs()
    model = SAT(_config(name))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(60):
        optimizer.zero_grad()
        out = model(batch)
        assert out.shape == (batch.num_nodes, 2)
        loss = torch.nn.functional.cross_entropy(out, batch.y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert min(losses[-10:]) < 0.5 * losses[0], (name, losses[0], losses[-10:])


@pytest.mark.parametrize("gnn_type", ["gcn", "gin", "gine", "sage", "pna"])
@pytest.mark.parametrize("edge_attr", [False, True])
def test_base_gnn_is_the_extractors_gnn_stack(gnn_type, edge_attr):
    """``architecture: gnn`` stacks the very base-GNN layer that SAT's extractors use, with edge
    features where that GNN takes them, and no attention or FFN."""
    batch = _graphs()
    if edge_attr:
        batch.edge_attr = torch.rand(batch.edge_index.size(1), 3)
    extra = dict(gnn_type=gnn_type, pna_degree_histogram=[1, 4, 6, 3, 1] if gnn_type == "pna" else None)
    if edge_attr:
        extra.update(edge_encoder="linear", edge_in_dim=3)
    gnn = SAT(_config("gnn", **extra))
    sat_model = SAT(_config("subtree", **extra))
    assert all(isinstance(layer, GNNLayer) for layer in gnn.layers) and len(gnn.layers) == 2
    assert all(isinstance(layer, SATLayer) for layer in sat_model.layers)
    assert type(gnn.layers[0].conv) is type(sat_model.layers[0].extractor.gnn.convs[0])
    names = {n for n, _ in gnn.named_parameters()}
    assert not any(".attn." in n or ".ffn." in n for n in names)
    assert gnn.uses_edge_attr == sat_model.uses_edge_attr
    out = gnn(batch)
    out.sum().backward()
    assert out.shape == (batch.num_nodes, 2) and torch.isfinite(out).all()


def test_base_gnn_layer_is_conv_norm_relu_residual():
    """x' = dropout(x + relu(norm(conv(x)))) (benchmarking-gnns' layer), checked in eval mode."""
    torch.manual_seed(0)
    layer = GNNLayer(8, "gcn", dropout=0.5, norm="layer").eval()
    x = torch.randn(5, 8)
    ei = torch.tensor([[0, 1, 1, 2, 3, 4], [1, 0, 2, 1, 4, 3]])
    out, weights = layer(x, None, ei)
    expected = x + torch.relu(layer.norm(layer.conv(x, ei)))
    assert weights is None and torch.allclose(out, expected, atol=1e-6)


def test_baseline_settings_are_checked():
    with pytest.raises(ValueError, match="model.readout: 'cls' needs attention"):
        _config("gnn", readout="cls", head="graph_classification")
    with pytest.raises(ValueError, match="model.architecture"):
        _config("gnn", architecture="mlp")
    # the base GNN reads no subgraph indices, whatever the extractor says
    assert not _config("gnn", extractor="subgraph", k_hops=1).needs_subgraphs
    assert _config("subgraph").needs_subgraphs
    model = SAT(_config("gnn"))
    with pytest.raises(ValueError, match="no attention weights"):
        model(_graphs(), return_attention=True)
    model.set_attention("dense")  # a no-op for GNN layers
    transformer = SAT(_config("transformer_rwpe"))
    assert all(layer.extractor is None for layer in transformer.layers)
