"""``recompute_gnn``: the structure extractors rerun their base GNN in the backward pass
(``torch.utils.checkpoint``) instead of keeping its activations, which for the k-subgraph
extractor grow with the subgraph entries (Chen et al., ICML 2022, Sec. 4.1), not the nodes.
"""
import functools

import pytest
import torch
from torch_geometric.data import Batch

from benchmarks.graphs.synthetic import code2_like_graphs
from sat import SAT, SATConfig, add_subgraph_indices
from sat.data import SUBGRAPH_KEYS
from sat.extractors import SubgraphExtractor, SubtreeExtractor
from tests.helpers import kept_for_backward

HIDDEN, EDGE_DIM = 16, 6


@functools.lru_cache(maxsize=None)
def _batch():
    return Batch.from_data_list([add_subgraph_indices(g, 2) for g in code2_like_graphs(6, seed=0)])


def _extractor(kind: str, recompute: bool, dtype=torch.float64):
    torch.manual_seed(0)
    cls = SubgraphExtractor if kind == "subgraph" else SubtreeExtractor
    return cls(HIDDEN, "gcn", 2, EDGE_DIM, concat_hops=True, recompute_gnn=recompute).to(dtype)


def _call(ext, batch, x, edge_attr):
    if isinstance(ext, SubgraphExtractor):
        return ext(x, batch.edge_index, edge_attr, **{k: batch[k] for k in SUBGRAPH_KEYS})
    return ext(x, batch.edge_index, edge_attr)


@pytest.mark.parametrize("kind", ["subgraph", "subtree"])
def test_recomputed_gnn_gives_the_same_outputs_gradients_and_running_statistics(kind):
    batch = _batch()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch.num_nodes, HIDDEN, generator=gen, dtype=torch.float64)
    edge_attr = torch.randn(batch.edge_index.size(1), EDGE_DIM, generator=gen, dtype=torch.float64)
    probe = torch.randn(batch.num_nodes, HIDDEN, generator=gen, dtype=torch.float64)
    runs = {}
    for recompute in (False, True):
        ext = _extractor(kind, recompute)
        xi, ei = x.clone().requires_grad_(), edge_attr.clone().requires_grad_()
        out = _call(ext, batch, xi, ei)
        grads = torch.autograd.grad((out * probe).sum(), [xi, ei, *ext.parameters()])
        runs[recompute] = (out.detach(), grads, ext.norm)
    (out, grads, norm), (ref, ref_grads, ref_norm) = runs[True], runs[False]
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    # BatchNorm is outside the recomputed part: its statistics move once per step, as without it
    assert int(norm.num_batches_tracked) == 1
    torch.testing.assert_close(norm.running_mean, ref_norm.running_mean, rtol=1e-12, atol=1e-12)


def _saved_bytes(fn) -> int:
    return sum(t.untyped_storage().nbytes() for t in kept_for_backward(fn))


def test_recomputed_subgraph_extractor_keeps_per_node_tensors_only():
    """Without recomputation the extractor keeps several [S, d] tensors per GNN layer; with it,
    only the per-node input of BatchNorm and the projection ([N, 2d] each) and the like."""
    batch = _batch()
    num_entries = batch.subgraph_node_index.numel()
    assert num_entries > 8 * batch.num_nodes  # the regime where this matters
    x = torch.randn(batch.num_nodes, HIDDEN, requires_grad=True)
    edge_attr = torch.randn(batch.edge_index.size(1), EDGE_DIM, requires_grad=True)
    kept = {r: _saved_bytes(lambda: _call(_extractor("subgraph", r, torch.float32), batch, x, edge_attr))
            for r in (False, True)}
    row = HIDDEN * 4  # bytes of one fp32 row of width d
    assert kept[False] > 3 * num_entries * row
    # recomputed: the concatenation [x, x, h_1, h_2] and BatchNorm's output, 4 rows each, and small statistics
    assert kept[True] < 1.5 * 2 * 4 * batch.num_nodes * row
    assert kept[True] < kept[False] / 5


def test_model_config_turns_recomputation_on_and_eval_ignores_it():
    batch = _batch()
    config = SATConfig(hidden_dim=HIDDEN, num_heads=2, num_layers=1, node_in_dim=1, extractor="subgraph",
                       node_encoder="constant", recompute_gnn=True)
    model = SAT(config)
    assert model.layers[0].extractor.recompute_gnn
    model.eval()
    with torch.no_grad():
        out = model(batch)
    plain = SAT(SATConfig.from_dict({**config.to_dict(), "recompute_gnn": False}))
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(out, plain.eval()(batch))
