"""Every extractor x GNN type x readout x PE combination builds, runs forward and backward, with and
without edge attributes; every trainable parameter that can influence the output receives a finite,
clearly non-zero gradient, and those that provably cannot (see `_provably_zero_grads`) get ~0."""
import copy
import fnmatch
import functools
import itertools

import pytest
import torch
from torch_geometric.data import Batch
from torch_geometric.nn import GINConv, GINEConv, PNAConv, SAGEConv

from sat import SAT, SATConfig, SATData, add_subgraph_indices, laplacian_pe, random_walk_pe
from sat.extractors import FixedShapeGCNConv, SubgraphExtractor

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


# ------------------------------------------------------------------ gradient check
# Some parameters get a gradient that is exactly zero in exact arithmetic (below). In float32 such a
# gradient comes out as rounding noise (~1e-8 of the gradient norm here) whose being "> 0" depends
# on the CPU's kernels (a PNA bias once passed on one machine and failed on another). So the
# check runs on a float64 copy of the model: there the noise is ~1e-16 of the norm, the smallest
# genuine gradient in this file is ~1e-5 of it, and GRAD_RTOL lies orders of magnitude from both.
GRAD_RTOL = 1e-9

# Parameters of a base-GNN layer whose only effect is the same per-feature shift of the layer's
# output at every node: its output bias (PNA: also the towers' output biases, mixed by `lin`).
# EdgeGCNConv has none: its biases act inside ReLUs.
_OUTPUT_SHIFT = {
    FixedShapeGCNConv: ("bias",),
    SAGEConv: ("lin_l.bias",),
    GINConv: ("nn.2.bias",),
    GINEConv: ("nn.2.bias",),
    PNAConv: ("lin.bias", "post_nns.*.0.bias"),
}


class _Activations:
    """Forward hooks that record what the rules of `_provably_zero_grads` look at."""

    def __init__(self, model):
        self.last_conv = {}  # layer -> pre-ReLU output of its extractor's last GNN layer [N or S, d]
        self.subgraph_sizes = {}  # layer -> number of k-subgraph entries per centre [N]
        self.values = {}  # layer -> (input of the attention's values [N, d], graph of every node [N])
        for i, layer in enumerate(model.layers):
            if layer.extractor is not None:
                layer.extractor.gnn.convs[-1].register_forward_hook(functools.partial(self._conv, i))
                if isinstance(layer.extractor, SubgraphExtractor):
                    layer.extractor.register_forward_pre_hook(functools.partial(self._subgraph, i), with_kwargs=True)
            layer.attn.register_forward_pre_hook(functools.partial(self._attn, i))

    def _conv(self, i, module, args, out):
        self.last_conv[i] = out.detach()

    def _subgraph(self, i, module, args, kwargs):
        self.subgraph_sizes[i] = torch.bincount(kwargs["subgraph_indicator"], minlength=args[0].size(0))

    def _attn(self, i, module, args):
        x, _, layout = args[:3]
        self.values[i] = (x.detach(), layout.batch)


def _identical_rows_per_graph(x, graph):
    first = torch.zeros(int(graph.max()) + 1, dtype=torch.long).scatter_reduce(
        0, graph, torch.arange(graph.numel()), "amin", include_self=False
    )
    return bool(((x - x[first[graph]]).abs() <= 1e-12 * (1 + x.abs().max())).all())


def _provably_zero_grads(model, acts):
    """``{name: (mask, reason)}``: the entries of the parameters whose gradient is exactly zero in
    exact arithmetic, for this model (in its current mode) on the batch recorded in ``acts``.

    A constant added to a feature at every node, right before a BatchNorm in training mode, moves
    the batch mean by the same constant and cancels; a constant added to all of one query's scores
    cancels in its softmax. Four ways for a parameter to do only that, or to be unused, exist in SAT:

    1. Key bias of the attention (``to_qk.bias``, second half; SAT builds it without bias): it adds
       ``q_i . b_k`` to every score of query ``i``, the same for every key, and softmax cancels it.
       NOT cancelled, contrary to a first reading: a query bias, or any constant added
       to the structure features ``x_struct`` of every node (``extractor.out_proj.bias``,
       ``extractor.norm.bias``): it shifts the queries too, adding ``b_q . k_j``, which varies with
       the key ``j``.
    2. Identical values: when the value inputs of every node of a graph are equal (e.g. a constant
       node encoder without PE, first layer), the attention output is that value whatever the
       weights, so the layer's query/key path (``to_qk``, the whole extractor, and the edge
       encoder if it feeds only such extractors) has no effect. Attention dropout breaks it.
    3. The last GNN layer's output bias (``_OUTPUT_SHIFT``) is followed by ReLU and the extractor's
       BatchNorm. A feature whose pre-ReLU output is <= 0 at every node passes no gradient (dead);
       one that is > 0 at every node passes the shift unchanged and BatchNorm cancels it (the
       k-subgraph extractor sum-pools the entries first: the shift becomes ``c * |S(u)|``, still
       cancelled if all subgraphs have the same size). If every feature is one or the other, the
       bias has no effect. That depends on the data and the initialisation, not on the config:
       it is the PNA case above (subtree, PNA, no edge features: every output feature of the second PNA layer
       has one sign over the whole batch); the mean/sum readouts of that combination are in the
       same case and used to pass on rounding noise alone.
    4. Output biases of the residual branches (``ffn.3.bias``; ``attn.out_proj.bias`` when the
       attention output is not degree-scaled, i.e. [CLS] readout or ``degree_scaling=False``)
       without dropout on the branch: a shift of the residual stream that only BatchNorms in
       training mode read (post-norm: the layer's norm1/norm2; pre-norm: every norm1/norm2 and the
       final norm). Dropout (per-node masks) makes the shift non-uniform, so with ``dropout > 0``
       these get a genuine gradient. Not covered: uniform input shifts under pre-norm BatchNorm
       (PE or linear node-encoder biases) -- no configuration here has them; one would fail the
       check on every machine alike, not by luck.
    """
    params = dict(model.named_parameters())
    zero = {}

    def mark(name, reason, mask=None):
        zero[name] = (torch.ones_like(params[name], dtype=torch.bool) if mask is None else mask, reason)

    cfg = model.config
    degree_scaled = cfg.degree_scaling and cfg.readout != "cls"  # as in SAT.forward
    batch_norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm1d)]
    stream_read_by_bn_only = (
        cfg.pre_norm and cfg.norm == "batch" and model.final_norm is not None and all(m.training for m in batch_norms)
    )
    qk_dead = []
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        bias = layer.attn.to_qk.bias
        if bias is not None:  # rule 1
            mask = torch.zeros_like(bias, dtype=torch.bool)
            mask[bias.numel() // 2 :] = True
            mark(p + "attn.to_qk.bias", "key bias: softmax cancels a shift common to all of a query's scores", mask)
        x, graph = acts.values[i]
        attn_dropout = layer.attn.training and layer.attn.dropout > 0
        qk_dead.append(not attn_dropout and _identical_rows_per_graph(x, graph))
        if qk_dead[-1]:  # rule 2
            for name in params:
                if name.startswith((p + "attn.to_qk.", p + "extractor.")):
                    mark(name, "identical values within each graph: the attention output ignores the weights")
        ext = layer.extractor
        if ext is not None and not qk_dead[-1]:  # rule 3
            z = acts.last_conv[i]
            dead, alive = (z <= 0).all(0), (z > 0).all(0)
            sizes = acts.subgraph_sizes.get(i)
            uniform = sizes is None or bool((sizes == sizes[0]).all())
            if bool((dead | (alive & uniform & ext.norm.training)).all()):
                conv = ext.gnn.convs[-1]
                for name, _ in conv.named_parameters():
                    if any(fnmatch.fnmatch(name, pat) for pat in _OUTPUT_SHIFT.get(type(conv), ())):
                        mark(
                            f"{p}extractor.gnn.convs.{len(ext.gnn.convs) - 1}.{name}",
                            "last GNN layer's output bias: every feature is dead or BatchNorm-cancelled",
                        )
        # rule 4
        if cfg.pre_norm:
            cancels = [stream_read_by_bn_only] * 2
        else:
            cancels = [isinstance(n, torch.nn.BatchNorm1d) and n.training for n in (layer.norm1, layer.norm2)]
        no_dropout = [not (d.training and d.p > 0) for d in (layer.dropout1, layer.dropout2)]
        if cancels[0] and no_dropout[0] and not degree_scaled:
            mark(p + "attn.out_proj.bias", "uniform shift of the residual stream, cancelled by BatchNorm")
        if cancels[1] and no_dropout[1]:
            mark(p + "ffn.3.bias", "uniform shift of the residual stream, cancelled by BatchNorm")
    if model.edge_encoder is not None and all(qk_dead):  # rule 2: edge features only reach extractors
        for name in params:
            if name.startswith("edge_encoder."):
                mark(name, "edge features feed only extractors whose attention ignores its weights")
    return zero


def _cast_linear_input(module, args):
    # the encoders cast some inputs to float32 (they expect autocast); follow the weights instead
    return tuple(a.to(module.weight.dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def _check_all_grads(model, batch):
    """Backpropagate a random linear function of every output of a float64 copy of ``model`` (in
    its current mode, dropout seeded) on ``batch``, and check: every gradient is finite; the
    entries `_provably_zero_grads` names sum to |g| <= GRAD_RTOL * ||g||; every other parameter's
    remaining entries sum to more than that. Returns the rules' ``{name: (mask, reason)}``."""
    m = copy.deepcopy(model).double()
    m.zero_grad(set_to_none=True)
    for mod in m.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.register_forward_pre_hook(_cast_linear_input)
    acts = _Activations(m)
    b = batch.clone().apply(lambda t: t.double() if t.is_floating_point() else t)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        out = m(b)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    (out * weights).sum().backward()
    grads = {name: p.grad for name, p in m.named_parameters() if p.requires_grad}
    nonfinite = [name for name, g in grads.items() if g is not None and not torch.isfinite(g).all()]
    assert not nonfinite, f"non-finite gradients: {nonfinite}"
    norm = torch.sqrt(sum(g.pow(2).sum() for g in grads.values() if g is not None))
    tol = GRAD_RTOL * float(norm)
    zero = _provably_zero_grads(m, acts)
    leaked = {name: why for name, (mask, why) in zero.items() if grads[name] is not None and grads[name][mask].abs().sum() > tol}
    assert not leaked, f"parameters that should get no gradient have one (a rule is wrong): {leaked}"
    weak = []
    for name, g in grads.items():
        mask = zero[name][0] if name in zero else torch.zeros_like(m.get_parameter(name), dtype=torch.bool)
        if bool(mask.all()):
            continue
        if g is None or not g[~mask].abs().sum() > tol:
            weak.append(name)
    assert not weak, f"parameters without gradient: {weak}"
    return zero


def _check_grads_exist(model):
    """The float32 backward pass reached every parameter, with finite values."""
    missing = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"parameters without gradient: {missing}"
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
    _check_grads_exist(model)
    _check_all_grads(model, batch)


VARIANTS = {
    "k0-transformer": dict(k_hops=0),
    "k0-cls-lap": dict(k_hops=0, readout="cls", pe="lap", pe_dim=3),
    "k1-concat-gcn-edges": dict(k_hops=1, concat_hops=True, edge_encoder="linear", edge_in_dim=4),
    "k3-concat-subgraph-pna": dict(k_hops=3, concat_hops=True, extractor="subgraph", gnn_type="pna",
                                   pna_degree_histogram=PNA_HIST, edge_encoder="linear", edge_in_dim=4),
    "layernorm-prenorm-dropout": dict(norm="layer", pre_norm=True, attn_dropout=0.2),
    "batchnorm-prenorm": dict(pre_norm=True),
    "no-degree-scaling": dict(degree_scaling=False),
    "regression-head": dict(head="graph_regression", num_classes=2),
    "node-head-cls": dict(head="node_classification", readout="cls", extractor="subgraph"),
    "node-head-mean": dict(head="node_classification"),
    "edge-embedding": dict(gnn_type="gine", edge_encoder="embedding", edge_in_dim=3, edge_in_columns=2),
    "linear-nodes": dict(node_encoder="linear", node_in_dim=3),
    "constant-nodes": dict(node_encoder="constant"),
    "no-dropout": dict(dropout=0.0),  # rule 4 of _provably_zero_grads (post-norm)
    "no-dropout-cls-prenorm": dict(dropout=0.0, readout="cls", pre_norm=True),  # rule 4 (pre-norm)
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
    _check_grads_exist(model)
    _check_all_grads(model, batch)


@pytest.mark.parametrize("how", ["output-times-zero", "output-replaced"])
def test_gradient_check_catches_a_disconnected_module(how):
    """The check keeps its power: a module whose output does not reach the loss is flagged, both
    when it stays in the autograd graph (exact zero gradient) and when it leaves it (no gradient)."""
    cfg = SATConfig(hidden_dim=8, num_heads=2, num_layers=2, node_in_dim=5, num_classes=3, gnn_type="gin")
    torch.manual_seed(0)
    model = SAT(cfg).train()
    batch = _batch(edge_attr=False)
    _check_all_grads(model, batch)  # intact
    if how == "output-times-zero":
        model.layers[1].ffn.register_forward_hook(lambda module, args, out: out * 0.0)
        culprits = ["layers.1.ffn.0.weight", "layers.1.ffn.0.bias", "layers.1.ffn.3.weight", "layers.1.ffn.3.bias"]
    else:
        model.layers[0].extractor.register_forward_hook(lambda module, args, out: torch.zeros_like(out))
        culprits = ["layers.0.extractor.gnn.convs.0.eps", "layers.0.extractor.out_proj.bias"]
    with pytest.raises(AssertionError, match="parameters without gradient") as err:
        _check_all_grads(model, batch)
    for name in culprits:
        assert repr(name) in str(err.value)


def test_key_bias_gradient_is_cancelled_by_the_softmax():
    """Rule 1 of `_provably_zero_grads`, on attention with query/key biases: the key half of the
    bias gets ~0 (checked) and the query half a clearly non-zero gradient (checked too)."""
    cfg = SATConfig(hidden_dim=8, num_heads=2, num_layers=1, node_in_dim=5, num_classes=3)
    torch.manual_seed(0)
    model = SAT(cfg).train()
    model.layers[0].attn.to_qk = torch.nn.Linear(8, 16, bias=True)
    torch.nn.init.normal_(model.layers[0].attn.to_qk.bias)
    zero = _check_all_grads(model, _batch(edge_attr=False))
    assert zero["layers.0.attn.to_qk.bias"][0].tolist() == [False] * 8 + [True] * 8


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
    from sat.config import PNASettings
    from sat.extractors import _GNNStack

    batch = _shared_batch(True)
    torch.manual_seed(0)
    stack = _GNNStack(8, gnn, 2, 4 if gnn != "sage" else None, True, PNASettings(tuple(PNA_HIST)))
    x = torch.randn(batch.num_nodes, 8)
    ea = torch.rand(batch.edge_index.size(1), 4)
    sni, seid = batch.subgraph_node_index, batch.subgraph_edge_id
    deferred = stack(x, batch.subgraph_edge_index, ea, node_index=sni, edge_id=seid)
    eager = stack(x[sni], batch.subgraph_edge_index, ea[seid])
    torch.testing.assert_close(deferred, eager, atol=1e-5, rtol=1e-4)
