"""Bad input raises one clear ValueError."""
import pytest
import torch
from torch_geometric.data import Batch

from sat import SAT, SATConfig, SATData, add_subgraph_indices, node_degree


def _data(n=5, k=None, **extra):
    ei = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4]])
    data = SATData(x=torch.zeros(n, 1, dtype=torch.long), edge_index=ei, **extra)
    return add_subgraph_indices(data, k) if k else data


def _model(**kw):
    base = dict(hidden_dim=8, num_heads=2, num_layers=1, node_in_dim=3)
    base.update(kw)
    return SAT(SATConfig(**base))


def _one_line(exc_info):
    msg = str(exc_info.value)
    assert "\n" not in msg and len(msg) < 300
    return msg


def test_edge_index_out_of_range():
    batch = Batch.from_data_list([_data()])
    batch.edge_index = torch.tensor([[0, 1], [1, 7]])
    with pytest.raises(ValueError, match=r"edge_index holds node ids outside \[0, 5\)") as e:
        _model()(batch)
    _one_line(e)
    batch.edge_index = torch.tensor([[0, -1], [1, 2]])
    with pytest.raises(ValueError, match="outside"):
        _model()(batch)


def test_edge_index_wrong_shape():
    batch = Batch.from_data_list([_data()])
    batch.edge_index = torch.tensor([[0, 1, 2]])
    with pytest.raises(ValueError, match=r"shape \[2, E\]"):
        _model()(batch)


def test_wrong_float_feature_width_for_linear_encoder():
    batch = Batch.from_data_list([_data()])
    batch.x = torch.rand(5, 4)
    with pytest.raises(ValueError, match=r"float x of shape \[N, 3\].*float32 \[5, 4\]") as e:
        _model(node_encoder="linear")(batch)
    _one_line(e)


def test_node_ids_outside_vocabulary():
    batch = Batch.from_data_list([_data()])
    batch.x = torch.full((5, 1), 3)
    with pytest.raises(ValueError, match="vocabulary"):
        _model()(batch)


def test_float_x_for_embedding_encoder():
    batch = Batch.from_data_list([_data()])
    batch.x = torch.rand(5, 1)
    with pytest.raises(ValueError, match="expects long x"):
        _model()(batch)


def test_wrong_pe_width():
    batch = Batch.from_data_list([_data(rwpe=torch.rand(5, 6))])
    with pytest.raises(ValueError, match=r"batch.rwpe of shape \[N=5, 4\].*\[5, 6\]") as e:
        _model(pe="rwpe", pe_dim=4)(batch)
    _one_line(e)
    with pytest.raises(ValueError, match="lap_pe"):
        _model(pe="lap", pe_dim=4)(batch)  # missing


def test_wrong_edge_feature_width():
    batch = Batch.from_data_list([_data(edge_attr=torch.rand(4, 3))])
    with pytest.raises(ValueError, match=r"edge_attr of shape \[E, 2\]"):
        _model(edge_encoder="linear", edge_in_dim=2, gnn_type="gine")(batch)


def test_missing_edge_attr_for_edge_aware_gnn():
    batch = Batch.from_data_list([_data()])
    with pytest.raises(ValueError, match="needs batch.edge_attr"):
        _model(edge_encoder="linear", edge_in_dim=2, gnn_type="gcn")(batch)


def test_subgraph_extractor_without_subgraph_indices():
    batch = Batch.from_data_list([_data(), _data()])
    with pytest.raises(ValueError, match="subgraph_node_index.*subgraph_indicator.*subgraph_edge_index.*subgraph_edge_id") as e:
        _model(extractor="subgraph")(batch)
    msg = _one_line(e)
    assert "add_subgraph_indices" in msg
    # a partial set names only what is missing
    batch = Batch.from_data_list([_data(k=1)])
    del batch.subgraph_edge_id
    with pytest.raises(ValueError, match=r"lacks \['subgraph_edge_id'\]"):
        _model(extractor="subgraph")(batch)
    # the same batch is fine for a k-subtree model and for k = 0
    _model(extractor="subtree")(Batch.from_data_list([_data()]))
    _model(extractor="subgraph", k_hops=0)(Batch.from_data_list([_data()]))


def test_unknown_gnn_type():
    with pytest.raises(ValueError, match=r"model.gnn_type: expected one of"):
        SATConfig(gnn_type="gat")


def test_pna_without_histogram_and_config_checks():
    # a job may leave the histogram to the pipeline (computed from the train shards); the model needs it
    config = SATConfig(gnn_type="pna")
    assert config.pna_settings() is None
    with pytest.raises(ValueError, match="pna_degree_histogram"):
        SAT(config)
    for bad, field in ((dict(pna_aggregators=["mean", "median"]), "model.pna_aggregators"),
                       (dict(pna_aggregators=[]), "model.pna_aggregators"),
                       (dict(pna_scalers=["log"]), "model.pna_scalers"),
                       (dict(hidden_dim=12, num_heads=4, pna_towers=5), "model.pna_towers"),
                       (dict(pna_degree_histogram=[3, -1]), "model.pna_degree_histogram")):
        with pytest.raises(ValueError, match=field):
            SATConfig(gnn_type="pna", **bad)
    settings = SATConfig(gnn_type="pna", hidden_dim=12, num_heads=4, pna_degree_histogram=[0, 2, 5]).pna_settings()
    assert settings.degree_histogram == (0, 2, 5) and settings.towers_for(12) == 4  # PyG's example: 4 towers
    with pytest.raises(ValueError, match="edge_in_dim"):
        SATConfig(edge_encoder="linear")
    with pytest.raises(TypeError, match="SATConfig"):
        SAT({"hidden_dim": 8})


def test_node_degree():
    ei = torch.tensor([[0, 1, 2, 0], [1, 2, 1, 2]])
    torch.testing.assert_close(node_degree(ei, 4), torch.tensor([1.0, 2.0, 2.0, 1.0]))
    torch.testing.assert_close(node_degree(torch.empty(2, 0, dtype=torch.long), 2), torch.ones(2))


def test_degree_attribute_is_used_when_present():
    torch.manual_seed(0)
    model = _model().eval()
    data = _data()
    base = model(Batch.from_data_list([data]))
    data.degree = node_degree(data.edge_index, 5)
    torch.testing.assert_close(model(Batch.from_data_list([data])), base)
    data.degree = torch.full((5,), 9.0)
    assert not torch.allclose(model(Batch.from_data_list([data])), base)
