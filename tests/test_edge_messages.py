"""The fused sum of GCN edge messages (:mod:`sat.edge_messages`) against torch.

On a machine without CUDA the Triton kernels run in Triton's CPU interpreter (``conftest.py``
sets ``TRITON_INTERPRET=1`` before anything imports triton); on a GPU machine the same tests run
the compiled kernels on CUDA tensors.
"""
import functools
import os

import pytest
import torch
from torch_geometric.data import Batch, Data
from torch_geometric.utils import erdos_renyi_graph

from sat import SAT, SATConfig, add_subgraph_indices
from sat import edge_messages
from sat.data import SUBGRAPH_KEYS
from sat.edge_messages import Grouping, RootTerm, aggregate_edge_messages, message_edges, resolve_impl
from sat.extractors import SubgraphExtractor, SubtreeExtractor
from tests.helpers import kept_for_backward

pytest.importorskip("triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels on CPU need its interpreter (TRITON_INTERPRET=1 from conftest.py)",
)
HIDDEN, EDGE_DIM = 16, 6


def _problem(width: int, dtype: torch.dtype, seed: int = 0, root: str = "none"):
    """Random inputs whose destinations include rows without edges and rows with many (more than
    one loop step of the kernel) and whose sources repeat, so every code path of the kernels runs.

    ``root``: ``none``, ``gathered`` (a root term reading rows ``root_index`` of ``a``) or
    ``identity`` (reading row ``v`` of ``a`` for output ``v``: then ``a`` has ``num_out`` rows).
    """
    gen = torch.Generator().manual_seed(seed)
    num_b, num_out = 17, 11
    num_a = num_out if root == "identity" else 13
    dst = torch.cat([torch.randint(0, num_out - 3, (50,), generator=gen), torch.full((9,), num_out - 2)])
    num_edges = dst.numel()
    tensors = dict(
        a=torch.randn(num_a, width, generator=gen, dtype=torch.float64),
        b=torch.randn(num_b, width, generator=gen, dtype=torch.float64),
        ia=torch.randint(0, num_a - 1, (num_edges,), generator=gen),  # row num_a - 1 is read by no edge
        ib=torch.randint(0, num_b, (num_edges,), generator=gen),
        dst=dst,
        norm=torch.rand(num_edges, generator=gen) + 0.1,
        probe=torch.randn(num_out, width, generator=gen, dtype=torch.float64),
    )
    if root != "none":
        tensors["root_bias"] = 0.5 * torch.randn(width, generator=gen, dtype=torch.float64)
        tensors["root_weight"] = torch.rand(num_out, generator=gen, dtype=torch.float64) + 0.1
        if root == "gathered":  # the last output reads row 0 (as no edge does), no output reads num_a - 1
            tensors["root_index"] = torch.cat([torch.randint(0, num_a - 1, (num_out - 1,), generator=gen),
                                               torch.zeros(1, dtype=torch.long)])
    tensors = {k: v.to(DEVICE) for k, v in tensors.items()}
    for k in ("a", "b", "probe"):
        tensors[k] = tensors[k].to(dtype)
    return tensors, num_out


def _sum_and_grads(impl: str, t: dict, num_out: int):
    """The sum and its gradients in ``a``, ``b`` and, with a root term, its bias (kept fp32 or fp64,
    as a parameter under autocast)."""
    leaves = [t["a"].detach().requires_grad_(), t["b"].detach().requires_grad_()]
    root = bias = None
    if "root_bias" in t:
        bias = t["root_bias"].to(torch.promote_types(t["a"].dtype, torch.float32)).requires_grad_()
        root = RootTerm(t.get("root_index"), t["root_weight"])
        leaves.append(bias)
    edges = message_edges(t["ia"], t["ib"], t["dst"], t["norm"], t["a"].size(0), t["b"].size(0), num_out, root)
    out = aggregate_edge_messages(*leaves[:2], edges, bias, impl)
    return (out, *torch.autograd.grad(out, leaves, t["probe"]))


def _exact(t: dict, num_out: int):
    return _sum_and_grads("torch", {k: (v.double() if v.is_floating_point() else v) for k, v in t.items()}, num_out)


# (edges per loop step, columns per program, warps): the default, one column block per 64
# (300 = 4 full blocks + a partial one) with loops of many steps, and wide edge tiles
LAUNCH_CONFIGS = [None, (2, 64, 1), (16, 128, 2)]


@pytest.mark.parametrize("config", LAUNCH_CONFIGS)
@pytest.mark.parametrize("width", [20, 300])  # one partial column block; several, the last one partial
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_fused_sum_and_gradients_match_torch(dtype, width, config, monkeypatch):
    if config is not None:
        for rows in ("short", "long"):
            monkeypatch.setitem(edge_messages.KERNEL_CONFIGS, rows, config)
    t, num_out = _problem(width, dtype)
    fused, exact = _sum_and_grads("fused", t, num_out), _exact(t, num_out)
    assert fused[0].dtype == dtype
    assert exact[0][num_out - 1].abs().max() == 0 and exact[2].abs().max() > 0  # an empty row; live gradients
    assert fused[1][-1].abs().max() == 0  # the row of a that no edge reads gets no gradient
    _assert_close_to_exact(fused, exact, dtype)


def _assert_close_to_exact(fused, exact, dtype):
    # fp64 accumulation is exact to rounding; fp32 accumulation of bf16/fp32 inputs (the torch
    # path rounds every message and partial sum to the input dtype instead: fused is the closer one)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    for name, f, e in zip(["out", "grad_a", "grad_b", "grad_root_bias"], fused, exact):
        torch.testing.assert_close(f.double(), e, rtol=tol, atol=tol * e.abs().max().item(), msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("config", [None, (16, 128, 2)])
@pytest.mark.parametrize("root", ["gathered", "identity"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_root_term_joins_the_fused_sum(dtype, root, config, monkeypatch):
    """``out[v] += w[v] * relu(a[index[v]] + bias)``: the outputs without edges get only it, rows
    of ``a`` read by roots alone get gradient from it, and the bias gets the sum over all outputs
    (in one chunk of outputs, or in several, the last one partial)."""
    if config is not None:
        for rows in ("short", "long"):
            monkeypatch.setitem(edge_messages.KERNEL_CONFIGS, rows, config)
        monkeypatch.setattr(edge_messages, "ROOT_GRAD_ROWS", 4)
    t, num_out = _problem(300, dtype, seed=2, root=root)
    fused, exact = _sum_and_grads("fused", t, num_out), _exact(t, num_out)
    assert fused[0].dtype == dtype and fused[3].dtype == torch.promote_types(dtype, torch.float32)
    assert exact[0][num_out - 1].abs().max() > 0  # no edges into it: the root term alone
    if root == "gathered":
        assert exact[1][0].abs().max() > 0 and exact[1][-1].abs().max() == 0
    _assert_close_to_exact(fused, exact, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_linear_map_formed_inside_and_again_in_the_backward_pass(dtype):
    """With ``linear`` the sum reads ``linear(a)``: the fused path forms it (under autocast in bf16,
    as the module would) and forms it again for the backward pass instead of keeping it; outputs
    and the gradients into ``a``, ``b``, the root bias and the map's weight and bias match torch."""
    t, num_out = _problem(24, torch.float64, seed=3, root="gathered")
    edges = message_edges(t["ia"], t["ib"], t["dst"], t["norm"], t["a"].size(0), t["b"].size(0), num_out,
                          RootTerm(t["root_index"], t["root_weight"]))
    results = {}
    for impl in ("fused", "torch"):
        torch.manual_seed(0)
        linear = torch.nn.Linear(24, 24, dtype=torch.float64 if dtype == torch.float64 else torch.float32).to(DEVICE)
        x = t["a"].to(linear.weight.dtype).detach().requires_grad_()
        b = t["b"].to(dtype).detach().requires_grad_()
        bias = t["root_bias"].to(linear.weight.dtype).detach().requires_grad_()
        outs = []
        with torch.autocast(DEVICE.type, torch.bfloat16, enabled=dtype == torch.bfloat16):
            kept = kept_for_backward(lambda: outs.append(aggregate_edge_messages(x, b, edges, bias, impl, linear)))
        out = outs[0]
        leaves = [x, b, bias, linear.weight, linear.bias]
        results[impl] = out, torch.autograd.grad(out, leaves, t["probe"].to(out.dtype)), kept, x
    (out, grads, kept, x), (ref, ref_grads, _, _) = results["fused"], results["torch"]
    assert out.dtype == dtype
    rows_of_a = [k for k in kept if k.dim() == 2 and k.size(0) == t["a"].size(0)]
    assert [k.data_ptr() for k in rows_of_a] == [x.data_ptr()]  # its input, not linear(a)
    tol = 1e-12 if dtype == torch.float64 else 2e-2
    for name, f, r in zip(["out", "x", "b", "root_bias", "weight", "lin_bias"], (out, *grads), (ref, *ref_grads)):
        assert f.dtype == r.dtype, name
        torch.testing.assert_close(f.double(), r.double(), rtol=tol, atol=tol * r.abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")


def test_bf16_fused_results_are_the_exact_sums_rounded_once():
    """Messages and partial sums stay in fp32 inside the kernel, so each bf16 result is within one
    bf16 ulp (2**-7 relative; half of it when rounding to nearest, as CUDA does) of the exact sum.
    """
    t, num_out = _problem(64, torch.bfloat16, seed=1, root="gathered")
    exact = _exact(t, num_out)
    for name, fused, ref in zip(["out", "grad_a", "grad_b"], _sum_and_grads("fused", t, num_out), exact):
        bound = 2.0**-7 * ref.abs() + 1e-5 * ref.abs().max()
        assert ((fused.double() - ref).abs() <= bound).all(), name


@functools.lru_cache(maxsize=None)
def _batch(k: int):
    """Three small random graphs (the interpreter runs one Python call per output row)."""
    torch.manual_seed(0)
    graphs = [Data(edge_index=erdos_renyi_graph(n, 0.35), num_nodes=n) for n in (5, 7, 9)]
    return Batch.from_data_list([add_subgraph_indices(g, k) for g in graphs]).to(DEVICE)


def _extractor_run(ext, batch, x, edge_attr, probe):
    params = dict(ext.named_parameters())
    sub = {k: batch[k] for k in SUBGRAPH_KEYS}
    out = ext(x, batch.edge_index, edge_attr, **sub) if isinstance(ext, SubgraphExtractor) else ext(
        x, batch.edge_index, edge_attr)
    return out, torch.autograd.grad((out * probe).sum(), [x, edge_attr, *params.values()])


@pytest.mark.parametrize("kind", ["subgraph", "subtree"])
def test_extractor_with_fused_messages_matches_torch_in_float64(kind):
    """The whole k-subgraph extractor (both GCN layers: the first reads graph nodes, the second
    subgraph entries) and the k-subtree one, outputs and every gradient."""
    batch = _batch(2)
    cls = SubgraphExtractor if kind == "subgraph" else SubtreeExtractor
    torch.manual_seed(0)
    fused = cls(HIDDEN, "gcn", 2, EDGE_DIM, True, message_impl="fused").double().to(DEVICE)
    plain = cls(HIDDEN, "gcn", 2, EDGE_DIM, True, message_impl="torch").double().to(DEVICE)
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(batch.num_nodes, HIDDEN, dtype=torch.float64, device=DEVICE, requires_grad=True)
    edge_attr = torch.randn(batch.edge_index.size(1), EDGE_DIM, dtype=torch.float64, device=DEVICE,
                            requires_grad=True)
    probe = torch.randn(batch.num_nodes, HIDDEN, dtype=torch.float64, device=DEVICE)
    out, grads = _extractor_run(fused, batch, x, edge_attr, probe)
    ref, ref_grads = _extractor_run(plain, batch, x, edge_attr, probe)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    names = ["x", "edge_attr", *dict(fused.named_parameters())]
    for name, g, r in zip(names, grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-10, msg=lambda m: f"{name}: {m}")


def test_model_layers_share_the_message_edges_and_sort_each_index_once(monkeypatch):
    """The fused GCN layers of all SAT layers sum over one batch's subgraph edges: 2 SAT layers x
    2 GCN layers make 12 sums, forward and backward, over 4 indices (destinations, edge rows, the
    first GCN layer's graph-node sources, the second's entry sources), each sorted once per batch;
    the model matches the torch path in fp64, outputs and every parameter's gradient."""
    batch = _batch(2).clone()
    gen = torch.Generator().manual_seed(0)
    batch.x = torch.randn(batch.num_nodes, 4, generator=gen, dtype=torch.float64).to(DEVICE)
    batch.edge_attr = torch.randn(batch.edge_index.size(1), 3, generator=gen, dtype=torch.float64).to(DEVICE)
    config = dict(hidden_dim=HIDDEN, num_heads=2, num_layers=2, dropout=0.0, node_encoder="linear", node_in_dim=4,
                  edge_encoder="linear", edge_in_dim=3, extractor="subgraph", k_hops=2, num_classes=3)
    sorted_groupings, csr = [], Grouping.csr

    def counted_csr(grouping):
        if grouping._csr is None:
            sorted_groupings.append(grouping)
        return csr(grouping)

    monkeypatch.setattr(Grouping, "csr", counted_csr)
    results = {}
    for impl in ("fused", "torch"):
        torch.manual_seed(0)
        model = SAT(SATConfig(**config, gnn_messages=impl)).double().to(DEVICE)
        out = model(batch)
        probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEVICE)
        results[impl] = out, torch.autograd.grad((out * probe).sum(), list(model.parameters()))
        if impl == "fused":
            assert len(sorted_groupings) == len({id(g) for g in sorted_groupings}) == 4
    assert len(sorted_groupings) == 4  # the torch path sorts nothing
    (out, grads), (ref, ref_grads) = results["fused"], results["torch"]
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    for (name, _), g, r in zip(model.named_parameters(), grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-10, msg=lambda m: f"{name}: {m}")


def test_message_edges_name_what_does_not_fit():
    t, num_out = _problem(8, torch.float64, root="identity")
    with pytest.raises(ValueError, match="root term without index needs a row of a per output, got 12 rows for 11"):
        message_edges(t["ia"], t["ib"], t["dst"], t["norm"], num_out + 1, 17, num_out, RootTerm(None, t["root_weight"]))
    edges = message_edges(t["ia"], t["ib"], t["dst"], t["norm"], num_out, 17, num_out, RootTerm(None, t["root_weight"]))
    with pytest.raises(ValueError, match="index 11 rows of a and 17 of b, got a .13, 8. and b .17, 8."):
        aggregate_edge_messages(t["a"].new_zeros(13, 8), t["b"], edges, t["root_bias"], "torch")
    with pytest.raises(ValueError, match="root bias goes with edges built with a root term"):
        aggregate_edge_messages(t["a"], t["b"], edges, None, "torch")


def test_auto_takes_the_kernel_only_on_cuda_and_the_config_names_bad_values():
    assert resolve_impl("auto", torch.device("cpu")) == "torch"
    assert resolve_impl("auto", torch.device("cuda")) == "fused"
    assert resolve_impl("torch", torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="model.gnn_messages"):
        SATConfig(gnn_messages="triton")


def test_fused_subgraph_extractor_keeps_two_bf16_rows_per_entry_under_autocast():
    """What decides the k-subgraph extractor's memory: the ``[S, d]`` tensors autograd keeps. The
    fused GCN layers keep the first layer's output (for its ReLU, and the second layer's linear
    input) and the second's output (for its ReLU), in bf16: the root term is in the kernel, and
    the second layer's ``W x``, from which the kernels recompute their ReLU masks, is formed again
    in the backward pass. The torch path keeps fp32 ones too (its fp32 root term)."""
    batch = _batch(2)
    entries, width = batch.subgraph_node_index.numel(), 64
    kept = {}
    for impl in ("fused", "torch"):
        torch.manual_seed(0)
        ext = SubgraphExtractor(width, "gcn", 2, EDGE_DIM, message_impl=impl).to(DEVICE)
        x = torch.randn(batch.num_nodes, width, device=DEVICE, requires_grad=True)
        edge_attr = torch.randn(batch.edge_index.size(1), EDGE_DIM, device=DEVICE, requires_grad=True)
        with torch.autocast(DEVICE.type, torch.bfloat16):
            saved = kept_for_backward(lambda: ext(x, batch.edge_index, edge_attr, **{k: batch[k] for k in SUBGRAPH_KEYS}))
        kept[impl] = [(t.dtype, t.untyped_storage().nbytes()) for t in saved
                      if t.is_floating_point() and t.dim() == 2 and t.size(0) == entries]
    row_bytes = entries * width * torch.bfloat16.itemsize
    assert [dtype for dtype, _ in kept["fused"]] == [torch.bfloat16] * 2
    assert sum(n for _, n in kept["fused"]) <= 2 * row_bytes
    assert sum(n for _, n in kept["torch"]) >= 6 * row_bytes  # what the fused path saves
