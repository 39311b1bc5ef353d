"""Dense structure-aware attention (SDPA, padded blocks) agrees with a per-graph reference."""
import pytest
import torch
from torch_geometric.data import Batch

from sat import SAT, SATConfig
from sat.attention import GraphLayout, StructureAwareAttention
from tests.helpers import random_graph

# fp32 on CPU: both compute the same softmax in a different order of operations. They usually
# agree to ~1e-7, but SDPA's CPU kernel has been seen 3.6e-5 off on outputs of magnitude ~1. A
# masking or cross-graph error is O(0.1).
ATOL, RTOL = 1e-4, 1e-3

SIZES = [1, 7, 3, 40, 12, 25, 2, 9]  # very different sizes: several dense blocks plus padding


def _layout_and_inputs(seed=0, d=16, heads=4):
    gen = torch.Generator().manual_seed(seed)
    batch = torch.cat([torch.full((n,), g) for g, n in enumerate(SIZES)])
    x = torch.randn(batch.numel(), d, generator=gen)
    xs = torch.randn(batch.numel(), d, generator=gen)
    return batch, x, xs


def _reference(attn, x, xs):
    """Eq. 3-4 graph by graph, with an explicit softmax (SIZES' graphs, in node order)."""
    H, D = attn.num_heads, attn.head_dim
    q, k = attn.to_qk(xs).chunk(2, dim=-1)
    v = attn.to_v(x)
    outs = []
    for qg, kg, vg in zip(*(t.split(SIZES) for t in (q, k, v))):
        qg, kg, vg = (t.view(-1, H, D).transpose(0, 1) for t in (qg, kg, vg))  # [H, n, D]
        weights = (qg @ kg.transpose(-1, -2) * D**-0.5).softmax(-1)
        outs.append((weights @ vg).transpose(0, 1).reshape(-1, H * D))
    return attn.out_proj(torch.cat(outs))


@pytest.mark.parametrize("bucket_ratio", [None, 1.5])
def test_dense_attention_matches_the_reference_outputs_and_gradients(bucket_ratio):
    batch, x, xs = _layout_and_inputs()
    torch.manual_seed(0)
    attn = StructureAwareAttention(16, 4, impl="dense")
    results = []
    layout = GraphLayout.from_sizes(SIZES, bucket_ratio)
    for run in (lambda xi, xsi: attn(xi, xsi, layout)[0], lambda xi, xsi: _reference(attn, xi, xsi)):
        attn.zero_grad()
        xi, xsi = x.clone().requires_grad_(), xs.clone().requires_grad_()
        out = run(xi, xsi)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), xi.grad, xsi.grad, [p.grad.clone() for p in attn.parameters()]))
    d, r = results
    assert torch.isfinite(d[0]).all()
    for got, want in zip(d[:3] + tuple(d[3]), r[:3] + tuple(r[3])):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_attention_never_crosses_graphs():
    batch, x, xs = _layout_and_inputs()
    attn = StructureAwareAttention(16, 4).eval()
    out, _ = attn(x, xs, GraphLayout.from_sizes(SIZES))
    x2 = x.clone()
    x2[batch == 3] += 100.0  # perturb graph 3 only
    xs2 = xs.clone()
    xs2[batch == 3] -= 50.0
    out2, _ = attn(x2, xs2, GraphLayout.from_sizes(SIZES))
    same = batch != 3
    torch.testing.assert_close(out[same], out2[same])
    assert not torch.allclose(out[~same], out2[~same])


def test_returned_weights_agree_and_are_row_stochastic():
    batch, x, xs = _layout_and_inputs()
    attn = StructureAwareAttention(16, 4).eval()
    out, w = attn(x, xs, GraphLayout.from_sizes(SIZES), return_attention=True)
    out_plain, _ = attn(x, xs, GraphLayout.from_sizes(SIZES))
    torch.testing.assert_close(out, out_plain, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out, _reference(attn, x, xs), atol=ATOL, rtol=RTOL)
    assert w.shape == (len(SIZES), 4, max(SIZES), max(SIZES))
    for g, n in enumerate(SIZES):
        torch.testing.assert_close(w[g, :, :n, :n].sum(-1), torch.ones(4, n))
        assert w[g, :, n:, :].abs().sum() == 0 and w[g, :, :, n:].abs().sum() == 0


def test_dense_attention_bf16_autocast_is_finite():
    batch, x, xs = _layout_and_inputs()
    attn = StructureAwareAttention(16, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attn(x, xs, GraphLayout.from_sizes(SIZES))
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), _reference(attn, x, xs), atol=0.1, rtol=0.1)  # bf16 has ~3 significant digits


def test_cls_attention_maps():
    gen = torch.Generator().manual_seed(2)
    sizes = (4, 11, 6)
    batch = Batch.from_data_list([random_graph(n, gen) for n in sizes])
    cfg = SATConfig(hidden_dim=16, num_heads=4, num_layers=2, node_in_dim=6, readout="cls", num_classes=2)
    torch.manual_seed(0)
    model = SAT(cfg).eval()
    maps = model.cls_attention(batch)
    assert [m.shape for m in maps] == [(n,) for n in sizes]
    out, attention = model(batch, return_attention=True)
    torch.testing.assert_close(out, model(batch))
    assert len(attention) == 2 and attention[-1].shape == (3, 4, 12, 12)  # [CLS] + 11 nodes
    for g, (m, n) in enumerate(zip(maps, sizes)):
        assert (m >= 0).all()
        # [CLS] row: its attention over its own graph's nodes plus itself sums to 1
        total = m.sum() + attention[-1][g, :, 0, 0].mean()
        torch.testing.assert_close(total, torch.tensor(1.0))
    with pytest.raises(ValueError, match="readout='cls'"):
        SAT(SATConfig(hidden_dim=16, num_heads=4, node_in_dim=6)).cls_attention(batch)
