import torch
from torch_geometric.data import Batch, Data

from sat.data import SATData, add_subgraph_indices, k_hop_subgraph_indices


def _reference_khop(edge_index, num_nodes, k):
    """Per-node loop with PyG's k_hop_subgraph (what the vectorised helper must match)."""
    from torch_geometric.utils import k_hop_subgraph, to_undirected

    und = to_undirected(edge_index, num_nodes=num_nodes)
    nodes, centres, edge_ids = [], [], []
    for c in range(num_nodes):
        subset, _, _, _ = k_hop_subgraph(c, k, und, num_nodes=num_nodes)
        subset = subset.sort().values
        nodes.append(subset)
        centres.append(torch.full_like(subset, c))
        member = torch.zeros(num_nodes, dtype=torch.bool)
        member[subset] = True
        edge_ids.append((member[edge_index[0]] & member[edge_index[1]]).nonzero().view(-1))
    return torch.cat(nodes), torch.cat(centres), edge_ids


def test_khop_indices_match_per_node_reference():
    gen = torch.Generator().manual_seed(0)
    n = 30
    edge_index = torch.randint(0, n, (2, 50), generator=gen)
    for k in (1, 2, 3):
        out = k_hop_subgraph_indices(edge_index, n, k)
        nodes, centres, edge_ids = _reference_khop(edge_index, n, k)
        assert torch.equal(out["subgraph_node_index"], nodes)
        assert torch.equal(out["subgraph_indicator"], centres)
        for c in range(n):
            mine = out["subgraph_edge_id"][out["subgraph_indicator"][out["subgraph_edge_index"][0]] == c]
            assert torch.equal(mine.sort().values, edge_ids[c])
        # subgraph edges point at entries holding the edge's endpoints
        ends = out["subgraph_node_index"][out["subgraph_edge_index"]]
        assert torch.equal(ends, edge_index[:, out["subgraph_edge_id"]])


def test_batching_offsets_subgraph_indices():
    a = add_subgraph_indices(Data(x=torch.zeros(3, 1), edge_index=torch.tensor([[0, 1], [1, 2]])), 1)
    b = add_subgraph_indices(Data(x=torch.zeros(4, 1), edge_index=torch.tensor([[0, 2], [1, 3]])), 1)
    batch = Batch.from_data_list([a, b])
    assert isinstance(a, SATData)
    na = a.subgraph_node_index.numel()
    assert torch.equal(batch.subgraph_node_index[na:], b.subgraph_node_index + 3)
    assert torch.equal(batch.subgraph_indicator[na:], b.subgraph_indicator + 3)
    assert torch.equal(batch.subgraph_edge_index[:, a.subgraph_edge_index.size(1):], b.subgraph_edge_index + na)
    assert torch.equal(batch.subgraph_edge_id[a.subgraph_edge_id.numel():], b.subgraph_edge_id + 2)
    ends = batch.subgraph_node_index[batch.subgraph_edge_index]
    assert torch.equal(ends, batch.edge_index[:, batch.subgraph_edge_id])


def test_out_of_range_edges_rejected():
    import pytest

    with pytest.raises(ValueError, match="outside"):
        k_hop_subgraph_indices(torch.tensor([[0], [5]]), 3, 1)
