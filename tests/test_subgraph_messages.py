"""The k-subgraph extractor with GCN and edge features forms its first layer's messages once per
graph edge (``relu(W x_u + E e_uv)``, :class:`sat.extractors.EdgeGCNConv`) and gathers them per
subgraph edge. These tests check that this computes the same function, with the same gradients,
as the plain GNN run on the gathered inputs of every k-hop subgraph (Chen et al., ICML 2022,
Sec. 4.1), and the index identity it rests on.
"""
import functools

import pytest
import torch
import torch.nn.functional as F
from torch_geometric.data import Batch
from torch_geometric.utils import scatter

from benchmarks.graphs.synthetic import code2_like_graphs
from sat import add_subgraph_indices
from sat.extractors import EdgeGCNConv, SubgraphExtractor

HIDDEN, EDGE_DIM = 16, 6


@functools.lru_cache(maxsize=None)
def _batch(k: int):
    return Batch.from_data_list([add_subgraph_indices(g, k) for g in code2_like_graphs(6, seed=0)])


def _subgraph(batch):
    return dict(
        subgraph_node_index=batch.subgraph_node_index,
        subgraph_indicator=batch.subgraph_indicator,
        subgraph_edge_index=batch.subgraph_edge_index,
        subgraph_edge_id=batch.subgraph_edge_id,
    )


def _reference_conv(conv: EdgeGCNConv, x, edge_index, edge_attr):
    """OGB's GCN layer written out on already gathered inputs (no deferred maps, no PyG propagate)."""
    h = conv.linear(x)
    e = conv.edge_encoder(edge_attr)
    row, col = edge_index
    deg = torch.bincount(row, minlength=x.size(0)).float() + 1  # the layer's convention: norm in fp32
    norm = (deg.pow(-0.5)[row] * deg.pow(-0.5)[col]).to(x.dtype)
    msg = norm.view(-1, 1) * F.relu(h[row] + e)
    out = torch.zeros_like(h).index_add_(0, col, msg)
    return out + F.relu(h + conv.root_emb.weight) / deg.view(-1, 1).to(x.dtype)


def _reference_extractor(ext: SubgraphExtractor, x, edge_attr, sub):
    """``W [x_u || sum_{w in S_k(u)} GNN^(k)(S_k(u))_w]`` on the gathered inputs."""
    h = x[sub["subgraph_node_index"]]
    e = edge_attr[sub["subgraph_edge_id"]]
    hops = [h]
    for conv in ext.gnn.convs:
        h = F.relu(_reference_conv(conv, h, sub["subgraph_edge_index"], e))
        hops.append(h)
    h = torch.cat(hops, dim=-1) if ext.gnn.concat_hops else h
    pooled = scatter(h, sub["subgraph_indicator"], dim=0, dim_size=x.size(0), reduce="sum")
    return ext.out_proj(ext.norm(torch.cat([x, pooled], dim=-1)))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_subgraph_edges_copy_their_graph_edges(k):
    """A subgraph edge joins the entries of its graph edge's endpoints, per graph and after batching
    (``SATData.__inc__`` offsets node ids, entries and edge ids consistently)."""
    graphs = [add_subgraph_indices(g, k) for g in code2_like_graphs(6, seed=0)]
    for data in graphs + [Batch.from_data_list(graphs)]:
        node, sub_ei, eid = data.subgraph_node_index, data.subgraph_edge_index, data.subgraph_edge_id
        ei = data.edge_index
        assert sub_ei.size(1) > 0
        assert torch.equal(node[sub_ei[0]], ei[0][eid])
        assert torch.equal(node[sub_ei[1]], ei[1][eid])


@pytest.mark.parametrize("concat_hops", [False, True])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_subgraph_extractor_matches_reference_in_float64(k, concat_hops):
    batch = _batch(k)
    sub = _subgraph(batch)
    torch.manual_seed(k)
    ext = SubgraphExtractor(HIDDEN, "gcn", k, EDGE_DIM, concat_hops).double()
    with torch.no_grad():  # the root embedding starts at N(0, 1); the biases at +-1/sqrt(fan_in)
        for p in ext.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(batch.num_nodes, HIDDEN, dtype=torch.float64, requires_grad=True)
    edge_attr = torch.randn(batch.edge_index.size(1), EDGE_DIM, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(batch.num_nodes, HIDDEN, dtype=torch.float64)
    params = dict(ext.named_parameters())

    def run(fn):
        out = fn()
        grads = torch.autograd.grad((out * probe).sum(), [x, edge_attr, *params.values()])
        return out.detach(), grads

    out, grads = run(lambda: ext(x, batch.edge_index, edge_attr, **sub))
    ref, ref_grads = run(lambda: _reference_extractor(ext, x, edge_attr, sub))
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    for name, g, r in zip(["x", "edge_attr", *params], grads, ref_grads):
        assert r.abs().max() > 0, name  # every gradient is exercised
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-10, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("k", [1, 2])
def test_first_layer_per_graph_edge_equals_deferred_gathers(k):
    """The stack with ``graph_edge_index`` equals the stack without it (the per-entry path)."""
    batch = _batch(k)
    torch.manual_seed(0)
    ext = SubgraphExtractor(HIDDEN, "gcn", k, EDGE_DIM, True).double()
    x = torch.randn(batch.num_nodes, HIDDEN, dtype=torch.float64)
    edge_attr = torch.randn(batch.edge_index.size(1), EDGE_DIM, dtype=torch.float64)
    args = (x, batch.subgraph_edge_index, edge_attr)
    kw = dict(node_index=batch.subgraph_node_index, edge_id=batch.subgraph_edge_id)
    fused = ext.gnn(*args, **kw, graph_edge_index=batch.edge_index)
    deferred = ext.gnn(*args, **kw)
    torch.testing.assert_close(fused, deferred, rtol=1e-9, atol=1e-10)


def test_subgraph_extractor_bf16_autocast_on_cpu():
    batch = _batch(2)
    sub = _subgraph(batch)
    torch.manual_seed(0)
    ext = SubgraphExtractor(HIDDEN, "gcn", 2, EDGE_DIM, False).eval()
    x = torch.randn(batch.num_nodes, HIDDEN, requires_grad=True)
    edge_attr = torch.randn(batch.edge_index.size(1), EDGE_DIM)
    ref = ext(x, batch.edge_index, edge_attr, **sub)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ext(x, batch.edge_index, edge_attr, **sub)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05 * ref.abs().max().item())
