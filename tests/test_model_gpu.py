"""GPU parity and the sync-free training step (CUDA only; skipped without a GPU).

Run by the GPU check (`benchmarks/gpu/run.sh`, part "parity"). The packed ``varlen`` attention
(FlashAttention-2 over one sequence per graph) computes the same function as the padded ``dense``
SDPA (in fp32, the reference); bf16 results are compared with bf16 tolerances, fp32 ones with
fp32 tolerances. A training step on a batch from the pipeline's collator reads nothing back to
the host (``torch.cuda.set_sync_debug_mode("error")`` raises on any synchronising call).
"""
import pytest
import torch
from torch_geometric.data import Batch

from pipeline.train.loader import BatchCollator
from sat import SAT, SATConfig, SATData, add_subgraph_indices
from sat.attention import StructureAwareAttention, varlen_available
from sat.layout import GraphLayout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")
SIZES = [1, 7, 3, 40, 12, 25, 2, 9, 130, 64]


def _graphs(sizes=SIZES, seed=0, k=2):
    gen = torch.Generator().manual_seed(seed)
    graphs = []
    for n in sizes:
        ei = torch.randint(0, n, (2, 3 * n), generator=gen)
        ei = torch.cat([ei, ei.flip(0)], 1)
        data = SATData(
            x=torch.randint(0, 6, (n, 1), generator=gen), edge_index=ei,
            edge_attr=torch.rand(ei.size(1), 3, generator=gen), rwpe=torch.rand(n, 4, generator=gen),
            y=torch.randint(0, 3, (1,), generator=gen),
        )
        graphs.append(add_subgraph_indices(data, k))
    return graphs


def _config(**kw):
    base = dict(hidden_dim=64, num_heads=4, num_layers=2, node_in_dim=6, dropout=0.0, num_classes=3,
                edge_encoder="linear", edge_in_dim=3, pe="rwpe", pe_dim=4, gnn_type="gcn")
    base.update(kw)
    return SATConfig(**base)


def _attention_run(impl, dtype, layout, x, xs, attn):
    attn.impl = impl
    attn.zero_grad()
    xi, xsi = x.clone().requires_grad_(), xs.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        out, _ = attn(xi, xsi, layout)
    (out.float() * torch.linspace(-1, 1, out.numel(), device=CUDA).view_as(out)).sum().backward()
    return [out.float(), xi.grad, xsi.grad] + [p.grad.clone() for p in attn.parameters()]


def _rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.mark.skipif(not varlen_available(), reason="needs CUDA and torch with varlen_attn (>= 2.10)")
def test_varlen_matches_dense_outputs_and_gradients():
    layout = GraphLayout.from_sizes(SIZES).to(CUDA)
    gen = torch.Generator(device=CUDA).manual_seed(0)
    x = torch.randn(layout.num_nodes, 64, device=CUDA, generator=gen)
    xs = torch.randn(layout.num_nodes, 64, device=CUDA, generator=gen)
    torch.manual_seed(0)
    attn = StructureAwareAttention(64, 4).to(CUDA)
    ref = _attention_run("dense", torch.float32, layout, x, xs, attn)
    varlen = _attention_run("varlen", torch.bfloat16, layout, x, xs, attn)
    dense16 = _attention_run("dense", torch.bfloat16, layout, x, xs, attn)
    for v, d, r in zip(varlen, dense16, ref):  # bf16 (8 bits of mantissa): relative errors of ~1e-2
        assert _rel_err(v, r) < 3e-2 and _rel_err(d, r) < 3e-2
        assert _rel_err(v, d) < 3e-2


@pytest.mark.skipif(not varlen_available(), reason="needs CUDA and torch with varlen_attn (>= 2.10)")
@pytest.mark.parametrize("readout", ["mean", "cls"])
def test_model_auto_attention_uses_varlen_in_bf16_and_matches_dense(readout):
    graphs = _graphs()
    config = _config(readout=readout)
    torch.manual_seed(0)
    model = SAT(config).to(CUDA).eval()
    batch = BatchCollator(config)(graphs).to(CUDA)
    outs = {}
    for impl in ("auto", "dense"):
        model.set_attention(impl)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outs[impl] = model(batch, validate=False).float()
    assert model.layers[0].attn.resolve_impl(torch.empty(1, device=CUDA, dtype=torch.bfloat16)) == "dense"
    model.set_attention("auto")
    assert model.layers[0].attn.resolve_impl(torch.empty(1, device=CUDA, dtype=torch.bfloat16)) == "varlen"
    assert _rel_err(outs["auto"], outs["dense"]) < 3e-2


def test_fp32_on_gpu_matches_cpu():
    graphs = _graphs()
    config = _config(readout="mean", extractor="subgraph")
    torch.manual_seed(0)
    model = SAT(config).eval()
    cpu = model(Batch.from_data_list(graphs))
    gpu = model.to(CUDA)(BatchCollator(config)(graphs).to(CUDA), validate=False)
    torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("extractor,readout", [("subtree", "mean"), ("subgraph", "cls")])
def test_training_step_reads_nothing_back_to_the_host(precision, extractor, readout):
    """Forward, loss, backward, clipping and a fused AdamW step on a collated, pinned batch copied
    without blocking: no host synchronisation (set_sync_debug_mode('error') raises on one)."""
    graphs = _graphs()
    config = _config(readout=readout, extractor=extractor, dropout=0.1)
    torch.manual_seed(0)
    model = SAT(config).to(CUDA).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    collate = BatchCollator(config)
    cpu_batches = [collate(graphs[:6]).pin_memory(), collate(graphs[4:]).pin_memory()]

    def step(cpu_batch):
        batch = cpu_batch.to(CUDA, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = model(batch, validate=False)
        loss = torch.nn.functional.cross_entropy(out.float(), batch.y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    step(cpu_batches[0])  # warm-up: lazy initialisation (cuBLAS handles, autotuning) may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        losses = [step(b) for b in cpu_batches]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(torch.isfinite(loss).item() for loss in losses)


def test_fused_subgraph_messages_match_torch_in_bf16_with_less_memory():
    """The k-subgraph extractor's Triton message sums (gnn_messages auto = fused on CUDA) under bf16
    autocast, forward and backward, on code2-shaped graphs: as close to the fp32 result as the torch
    path in bf16 is (both round the linear maps to bf16), and with a lower peak memory, since the
    fused path keeps no [Es, d] activations."""
    from benchmarks.graphs.synthetic import code2_like_graphs
    from sat.data import SUBGRAPH_KEYS
    from sat.extractors import SubgraphExtractor

    graphs = [add_subgraph_indices(g, 2) for g in code2_like_graphs(24, seed=1)]
    batch = Batch.from_data_list(graphs).to(CUDA)
    sub = {k: batch[k] for k in SUBGRAPH_KEYS}
    torch.manual_seed(0)
    x = torch.randn(batch.num_nodes, 256, device=CUDA)
    edge_attr = torch.randn(batch.edge_index.size(1), 256, device=CUDA)
    results = {}
    for run, impl, bf16 in (("fused", "fused", True), ("torch", "torch", True), ("fp32", "torch", False)):
        torch.manual_seed(0)
        ext = SubgraphExtractor(256, "gcn", 2, 256, message_impl=impl).to(CUDA)
        xi, ei = x.clone().requires_grad_(), edge_attr.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            out = ext(xi, batch.edge_index, ei, **sub)
        (out.float() * torch.linspace(-1, 1, out.numel(), device=CUDA).view_as(out)).sum().backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        results[run] = ([out.float(), xi.grad, ei.grad] + [p.grad.clone() for p in ext.parameters()], peak)
    for i, (fused, plain, exact) in enumerate(zip(results["fused"][0], results["torch"][0], results["fp32"][0])):
        assert _rel_err(fused, exact) < max(2 * _rel_err(plain, exact), 1e-2), i
    assert results["fused"][1] < results["torch"][1]
