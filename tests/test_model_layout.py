"""The host-built batch layout (sat.layout) and the loader's collation give the model's own results.

The training pipeline builds every batch's GraphLayout and checks its values on the CPU, in the
DataLoader workers (pipeline.train.loader.BatchCollator), and runs the model with validate=False so that
the forward pass reads nothing back from an accelerator. These tests pin that this changes no
result: a layout built from sizes equals one built from the batch vector, and a model given the
collator's batch computes what it computes on a plain PyG batch.
"""
import numpy as np
import pytest
import torch
from torch_geometric.data import Batch

from pipeline.train.loader import BatchCollator
from sat import SAT, GraphLayout, SATConfig
from sat.attention import StructureAwareAttention
from tests.helpers import random_graph

SIZES = [1, 7, 3, 40, 12, 25, 2, 9]


def _graphs(sizes=SIZES, seed=0):
    gen = torch.Generator().manual_seed(seed)
    graphs = []
    for n in sizes:
        data = random_graph(n, gen, with_subgraphs=True)
        data.y = torch.randint(0, 3, (1,), generator=gen)
        graphs.append(data)
    return graphs


def _config(**kw):
    base = dict(hidden_dim=16, num_heads=4, num_layers=2, node_in_dim=6, dropout=0.0, num_classes=3,
                edge_encoder="linear", edge_in_dim=3, pe="rwpe", pe_dim=4)
    base.update(kw)
    return SATConfig(**base)


@pytest.mark.parametrize("bucket_ratio", [None, 1.5])
def test_layout_from_sizes_matches_the_batch_vector(bucket_ratio):
    batch = torch.cat([torch.full((n,), g) for g, n in enumerate(SIZES)])
    b = GraphLayout.from_sizes(SIZES, bucket_ratio)
    assert (b.num_graphs, b.num_nodes, b.max_nodes) == (8, 99, 40)
    assert torch.equal(b.batch, batch)
    assert b.ptr.tolist() == [0] + torch.tensor(SIZES).cumsum(0).tolist()
    assert torch.equal(b.local_index, torch.cat([torch.arange(n) for n in SIZES]))
    assert b.cu_seqlens.dtype == torch.int32 and b.cu_seqlens.tolist() == b.ptr.tolist()
    gb = b.dense_groups()
    for nodes, flat, _G, L in gb:
        assert torch.equal(flat % L, b.local_index[nodes])
    # every node appears in exactly one block, at a distinct position
    nodes = torch.cat([n for n, *_ in gb])
    assert sorted(nodes.tolist()) == list(range(99))


def test_cls_layout_places_one_cls_node_before_each_graph():
    layout = GraphLayout.from_sizes([2, 3], cls_token=True)
    assert layout.num_nodes == 7 and layout.num_input_nodes == 5 and layout.max_nodes == 4
    assert layout.cls_index.tolist() == [0, 3]
    assert layout.real_index.tolist() == [1, 2, 4, 5, 6]
    assert layout.batch.tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert layout.matches(5, cls=True, num_graphs=2) and not layout.matches(5, cls=False, num_graphs=2)
    assert not layout.matches(5, cls=True, num_graphs=3) and layout.node_mask is None


@pytest.mark.parametrize("readout", ["mean", "cls"])
@pytest.mark.parametrize("extractor", ["subtree", "subgraph"])
def test_collated_batch_gives_the_plain_batch_results(readout, extractor):
    """Model outputs and gradients on the collator's batch (host layout, validate=False) equal
    those on a plain PyG batch (layout built by the model, values validated)."""
    graphs = _graphs()
    config = _config(readout=readout, extractor=extractor, gnn_type="gine")
    torch.manual_seed(0)
    model = SAT(config).eval()
    plain = Batch.from_data_list(graphs)
    collated = BatchCollator(config)(graphs)
    assert isinstance(collated.graph_layout, GraphLayout)
    results = []
    for batch, validate in ((plain, True), (collated, False)):
        model.zero_grad()
        out = model(batch, validate=validate)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-6, rtol=1e-5)
    for ga, gb in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(ga, gb, atol=1e-6, rtol=1e-5)


def test_a_layout_for_another_model_is_not_used():
    """A layout built without [CLS] nodes is ignored by a [CLS] model (it builds its own)."""
    graphs = _graphs()
    config = _config(readout="cls")
    torch.manual_seed(0)
    model = SAT(config).eval()
    batch = BatchCollator(_config(readout="mean"))(graphs)
    assert not batch.graph_layout.has_cls
    torch.testing.assert_close(model(batch), model(Batch.from_data_list(graphs)))


def test_collator_checks_values_on_the_cpu():
    graphs = _graphs()
    graphs[2].x = torch.full_like(graphs[2].x, 6)  # outside the node vocabulary [0, 6)
    with pytest.raises(ValueError, match="vocabulary"):
        BatchCollator(_config())(graphs)


def test_auto_attention_is_dense_on_cpu_and_varlen_says_why_it_cannot_run():
    attn = StructureAwareAttention(16, 4)
    q = torch.randn(5, 4, 4)
    assert attn.impl == "auto" and attn.resolve_impl(q) == "dense"
    assert attn.resolve_impl(q.bfloat16()) == "dense"  # CPU: no packed kernel
    attn.impl = "varlen"
    with pytest.raises(ValueError, match="varlen.*CUDA.*auto"):
        attn.resolve_impl(q)


def test_layout_sizes_must_be_non_negative():
    with pytest.raises(ValueError, match="non-negative"):
        GraphLayout.from_sizes(np.array([3, -1]))
