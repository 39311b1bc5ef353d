"""Fixed-capacity batches (sat.padding): padding changes nothing the model computes on the real graphs.

The model of several job files and variants (each extractor, readout and task) runs in fp64 on a
batch and on the same batch padded to a larger capacity: the real rows of the output, the task's
loss, every gradient and BatchNorm's running statistics are equal. Dropout is off (its masks are
drawn per row, so a padded batch draws other ones).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch_geometric.data import Batch

from benchmarks.graphs.jobs import job_graphs
from pipeline.config import load_job
from pipeline.train.cuda_graphs import batch_tensors
from sat import SAT
from sat.layout import GraphLayout
from sat.norm import BatchNorm
from sat.padding import PAD_TARGET, Capacity, batch_counts, fits, pad_batch, padding_of

JOBS = Path(__file__).resolve().parents[1] / "jobs"
SMALL = ["model.hidden_dim=16", "model.num_heads=2", "model.num_layers=2", "model.dropout=0.0"]
CASES = {
    "pattern subtree gcn": ("pattern-local.yaml", []),
    "pattern subgraph gin": ("pattern-local.yaml", ["model.extractor=subgraph", "model.k_hops=1", "transform.k_hops=1",
                                                    "model.gnn_type=gin"]),
    "pattern base gnn sage": ("pattern-local.yaml", ["model.architecture=gnn", "model.gnn_type=sage"]),
    "pattern transformer": ("pattern-local.yaml", ["model.k_hops=0"]),
    "ppa subtree gcn edges": ("ppa.yaml", []),
    "ppa subtree pna": ("ppa.yaml", ["model.gnn_type=pna"]),
    "code2 subtree gcn edges": ("code2-local.yaml", []),
    "code2 cls readout": ("code2-local.yaml", ["model.readout=cls"]),
    "code2 subgraph gcn edges": ("code2-local.yaml", ["model.extractor=subgraph", "model.k_hops=1",
                                                      "transform.k_hops=1"]),
    "code2 gine sum pre-norm layernorm": ("code2-local.yaml", ["model.gnn_type=gine", "model.readout=sum",
                                                               "model.pre_norm=true", "model.norm=layer"]),
}


def _double(batch):
    return batch.apply(lambda t: t.double() if t.is_floating_point() else t)


def _roomy_capacity(batch, extra_graphs: int = 3) -> Capacity:
    c = batch_counts(batch)
    sub = c["subgraph_entries"] > 0
    return Capacity(nodes=c["nodes"] + 37, edges=c["edges"] + 51, graphs=c["graphs"] + extra_graphs,
                    graph_nodes=c["graph_nodes"] + 5, subgraph_entries=c["subgraph_entries"] + 23 if sub else 0,
                    subgraph_edges=c["subgraph_edges"] + 29 if sub else 0)


def _step(model, task, batch):
    out = model(batch)
    loss = task.loss(out, batch)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    return task.real_rows(out, batch).detach(), loss.detach(), grads, buffers


@pytest.mark.parametrize("case", list(CASES))
def test_padded_batch_gives_the_loss_gradients_and_statistics_of_the_batch(case):
    job_file, overrides = CASES[case]
    job = load_job(JOBS / job_file, SMALL + overrides)
    graphs, task, config = job_graphs(job, 5, seed=1)
    cls_token = config.readout == "cls"
    batch = Batch.from_data_list(graphs)
    batch.graph_layout = GraphLayout.from_sizes(torch.diff(batch.ptr), cls_token=cls_token)
    padded = pad_batch(batch, _roomy_capacity(batch), task.node_level, cls_token)
    assert padding_of(padded).graphs == 5 and padding_of(padded).nodes == batch.num_nodes
    assert task.batch_size(padded) == task.batch_size(batch) and task.targets(padded) == task.targets(batch)

    torch.manual_seed(0)
    model = SAT(config).double().train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    out, loss, grads, buffers = _step(model, task, _double(batch))
    model.load_state_dict(state)
    model.zero_grad(set_to_none=True)
    out_p, loss_p, grads_p, buffers_p = _step(model, task, _double(padded))

    torch.testing.assert_close(out_p, out, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(loss_p, loss, rtol=1e-10, atol=0)
    assert grads_p.keys() == grads.keys() and len(grads) == sum(1 for _ in model.parameters())
    for name in grads:
        torch.testing.assert_close(grads_p[name], grads[name], rtol=1e-8, atol=1e-11, msg=name)
    for name in buffers:
        torch.testing.assert_close(buffers_p[name], buffers[name], rtol=1e-10, atol=1e-12, msg=name)
    assert any(isinstance(m, BatchNorm) for m in model.modules())  # the statistics above skipped padding


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_statistics_skip_the_padding_rows(momentum):
    torch.manual_seed(0)
    plain, masked = BatchNorm(6).double(), BatchNorm(6).double()
    for bn in (plain, masked):
        bn.momentum = momentum
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
        plain.bias.uniform_(-1, 1)
    masked.load_state_dict(plain.state_dict())
    x = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    for _ in range(3):  # running averages over several batches, padding rows far off
        rows = torch.cat([x, 1e3 * torch.randn(4, 6, dtype=torch.float64)])
        mask = torch.arange(13) < 9
        y, y_masked = plain(x), masked(rows, mask)[:9]
    torch.testing.assert_close(y_masked, y, rtol=1e-12, atol=1e-12)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(masked, name), getattr(plain, name), rtol=1e-12, atol=1e-14)
    g, g_masked = (torch.autograd.grad((out ** 3).sum(), [x, bn.weight, bn.bias])
                   for out, bn in ((y, plain), (y_masked, masked)))
    for a, b in zip(g_masked, g):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    masked.eval()  # evaluation: the running statistics, rows independent, mask or not
    torch.testing.assert_close(masked(rows, mask), plain.eval()(rows), rtol=1e-12, atol=1e-12)


def test_padded_batches_of_one_capacity_share_every_shape():
    job = load_job(JOBS / "code2-local.yaml", SMALL + ["model.extractor=subgraph", "model.k_hops=1", "transform.k_hops=1"])
    graphs, task, config = job_graphs(job, 9, seed=2)
    first, second = Batch.from_data_list(graphs[:4]), Batch.from_data_list(graphs[4:])
    capacity = Capacity(nodes=max(b.num_nodes for b in (first, second)) + 10, edges=3000, graphs=6,
                        graph_nodes=1000, subgraph_entries=20000, subgraph_edges=40000)
    a, b = (pad_batch(x, capacity, task.node_level) for x in (first, second))
    shapes = [[(tuple(t.shape), t.dtype) for t in batch_tensors(x)] for x in (a, b)]
    assert shapes[0] == shapes[1]
    layout = a.graph_layout
    slots = capacity.graphs + capacity.padding_graphs  # the batch's graphs, then the padding graphs
    assert layout.num_graphs == slots and layout.max_nodes == capacity.graph_nodes
    assert layout.cu_seqlens.numel() == slots + 1
    assert int((layout.sizes[: capacity.graphs] > 0).sum()) == 4  # empty slots after the batch's graphs
    assert layout.sizes.max() <= capacity.graph_nodes and int(layout.node_mask.sum()) == first.num_nodes
    assert (a.y[4:] == PAD_TARGET).all() and a.y_tokens == first.y_tokens
    # padding edges and entries join padding rows only
    pad_edges = a.edge_index[:, first.edge_index.size(1):]
    assert (pad_edges >= first.num_nodes).all() and (pad_edges[0] == pad_edges[1]).all()
    assert (a.subgraph_node_index[first.subgraph_node_index.numel():] >= first.num_nodes).all()


def test_a_batch_over_capacity_is_named_and_left_alone():
    job = load_job(JOBS / "pattern-local.yaml", SMALL)
    graphs, task, _config = job_graphs(job, 3, seed=0)
    batch = Batch.from_data_list(graphs)
    tight = Capacity(nodes=batch.num_nodes, edges=batch.edge_index.size(1), graphs=3, graph_nodes=1000)
    assert not fits(batch, tight)  # every padded batch keeps one padding row
    with pytest.raises(ValueError, match=r"nodes \d+ > \d+"):
        pad_batch(batch, tight, task.node_level)
    batch.node_is_attributed = torch.zeros(batch.num_nodes)
    with pytest.raises(ValueError, match="'node_is_attributed' has no padding rule"):
        pad_batch(batch, _roomy_capacity(batch), task.node_level)
