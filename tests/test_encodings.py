import numpy as np
import pytest
import torch
from torch_geometric.data import Data
from torch_geometric.transforms import AddRandomWalkPE
from torch_geometric.utils import to_undirected

import sat.encodings as encodings


def _random_graph(n, seed):
    gen = torch.Generator().manual_seed(seed)
    edge_index = torch.randint(0, n, (2, 3 * n), generator=gen)
    return torch.cat([edge_index, torch.tensor([[0], [0]])], dim=1)  # a self-loop, ignored


@pytest.mark.parametrize("n,steps", [(30, 20), (200, 20), (57, 7), (12, 1)])
@pytest.mark.parametrize("blocked", [False, True])
def test_rwpe_matches_pyg_random_walk_pe(n, steps, blocked, monkeypatch):
    if blocked:  # several column blocks, as large graphs take
        monkeypatch.setattr(encodings, "RWPE_BLOCK", 16)
    edge_index = _random_graph(n, seed=n)
    mine = encodings.random_walk_pe(edge_index, n + 2, steps)  # the two last nodes are isolated
    und = to_undirected(edge_index[:, edge_index[0] != edge_index[1]], num_nodes=n + 2)
    ref = AddRandomWalkPE(steps, attr_name="pe")(Data(edge_index=und, num_nodes=n + 2)).pe
    assert mine.dtype == torch.float32 and mine.shape == (n + 2, steps)
    np.testing.assert_allclose(mine.numpy(), ref.numpy(), atol=2e-6)
    assert (mine[-2:] == 0).all()


def test_laplacian_pe_are_eigenvectors():
    edge_index = _random_graph(20, seed=1)
    pe = encodings.laplacian_pe(edge_index, 20, 4).double()
    adj = torch.zeros(20, 20, dtype=torch.float64)
    adj[edge_index[0], edge_index[1]] = 1
    adj = ((adj + adj.T) > 0).double().fill_diagonal_(0)
    d = adj.sum(1).clamp(min=1).rsqrt()
    lap = torch.eye(20, dtype=torch.float64) - d[:, None] * adj * d[None, :]
    rayleigh = (pe * (lap @ pe)).sum(0)
    np.testing.assert_allclose((lap @ pe).numpy(), (pe * rayleigh).numpy(), atol=1e-5)
    assert torch.allclose(pe.norm(dim=0), torch.ones(4, dtype=torch.float64), atol=1e-5)


def test_incident_edge_sum_and_degree():
    edge_index = torch.tensor([[0, 1, 2, 2], [1, 2, 1, 0]])
    attr = torch.tensor([[1.0], [2.0], [4.0], [8.0]])
    assert encodings.incident_edge_sum(edge_index, attr, 4).view(-1).tolist() == [8.0, 5.0, 2.0, 0.0]
    assert encodings.node_degree(edge_index, 4).tolist() == [1.0, 2.0, 1.0, 1.0]
