"""The fused k-subgraph message kernels (``sat/edge_messages.py``) on one GPU: a sweep of their
launch configurations on a code2-shaped batch, against the torch path.

    python -m benchmarks.gpu.messages [graphs]      # CUDA and Triton; prints JSON lines

(Without CUDA, with ``TRITON_INTERPRET=1``, it runs in Triton's interpreter: a dry run.)

One batch of ``graphs`` code2-shaped graphs (default 200, ~25k nodes: a node budget of 32768)
with 2-hop subgraph indices, the extractor of ``jobs/code2.yaml`` (GCN with edge embeddings,
d = 256, k = 2) in bf16. For the five kernel calls of one extractor pass (the forward sums of
both layers, the gradients into the first layer's graph nodes, the second layer's entries and
the edge embeddings), over the edges as the model sums them (the subgraph edges and a root edge
per entry; the gradient into edge embeddings over the subgraph edges alone), it times each launch configuration (CUDA events, median of 10), picks the
fastest for rows with few and with many edges, then times the whole extractor, forward and
backward, on the torch path and the fused path with the default and with the picked
configurations, and its peak memory.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

CONFIGS = [  # (BLOCK_E, BLOCK_D, num_warps)
    (4, 256, 4), (4, 128, 2), (4, 64, 1), (2, 64, 1), (2, 128, 1), (8, 64, 1), (8, 64, 2), (8, 128, 4),
    (16, 64, 2), (16, 64, 4), (16, 128, 4), (16, 256, 8), (32, 64, 4), (32, 128, 8), (1, 256, 2), (1, 64, 1),
    (4, 32, 1), (8, 32, 1), (32, 64, 2), (64, 64, 4),
]


def _time(fn, reps: int = 10) -> float:
    import torch

    fn()
    if not torch.cuda.is_available():  # CPU dry run (kernels in Triton's interpreter)
        began = time.perf_counter()
        fn()
        return 1000 * (time.perf_counter() - began)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(num_graphs: int = 200, d: int = 256) -> None:
    import torch
    from torch_geometric.data import Batch

    from benchmarks.graphs.synthetic import code2_like_graphs
    from sat import add_subgraph_indices
    from sat import edge_messages as em
    from sat.data import SUBGRAPH_KEYS
    from sat.extractors import SubgraphExtractor, gcn_message_edges

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    began = time.perf_counter()
    batch = Batch.from_data_list([add_subgraph_indices(g, 2) for g in code2_like_graphs(num_graphs, seed=0)]).to(dev)
    row = batch.subgraph_edge_index[0]
    node_index, edge_id = batch.subgraph_node_index, batch.subgraph_edge_id
    nodes, edges, entries, sub_edges = batch.num_nodes, batch.edge_index.size(1), node_index.numel(), row.numel()
    print(json.dumps(dict(graphs=num_graphs, nodes=nodes, edges=edges, entries=entries, subgraph_edges=sub_edges,
                          build_s=round(time.perf_counter() - began, 1), device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu")), flush=True)

    gen = torch.Generator(device=dev).manual_seed(0)

    # the edges as the model sums them: subgraph edges, then one root edge per entry
    first = gcn_message_edges(batch.subgraph_edge_index, nodes, edges, entries, torch.float32, node_index, edge_id)
    later = first.with_sources(row, entries)
    all_edges = first.dst.index.numel()
    a1 = torch.randn(nodes, d, device=dev, generator=gen).bfloat16()
    a2 = torch.randn(entries, d, device=dev, generator=gen).bfloat16()
    b = torch.randn(edges, d, device=dev, generator=gen).bfloat16()
    bias = torch.randn(d, device=dev, generator=gen)
    b_and_bias = torch.cat([b.float(), bias.view(1, -1)])  # as the kernels read them under autocast
    grad_out = torch.randn(entries, d, device=dev, generator=gen).bfloat16()
    norm = first.norm
    sort_ms = _time(lambda: em.Grouping(first.dst.index, entries).csr())

    def forward(a, sums):
        out = torch.empty(entries, d, device=dev, dtype=torch.bfloat16)
        return lambda cfg: em._launch(0, a, entries, d, all_edges, a, b_and_bias, sums.ia.index, sums.ib.index, norm,
                                      *sums.dst.csr(), out, config=cfg)

    def grad(own, other, own_rows, i_other, rows, num_edges):
        out = torch.empty_like(own)
        return lambda cfg: em._launch(1, own, rows, d, num_edges, own, other, i_other, first.dst.index, norm, grad_out,
                                      *own_rows.csr(), out, config=cfg)

    cases = {  # name: (launcher, rows, edges)
        "forward, layer 1": (forward(a1, first), entries, all_edges),
        "forward, layer 2": (forward(a2, later), entries, all_edges),
        "grad into graph nodes, layer 1": (grad(a1, b_and_bias, first.ia, first.ib.index, nodes, all_edges), nodes, all_edges),
        "grad into entries, layer 2": (grad(a2, b_and_bias, later.ia, first.ib.index, entries, all_edges), entries, all_edges),
        "grad into edge embeddings": (grad(b_and_bias[:edges], a2, first.ib, later.ia.index, edges, sub_edges), edges, sub_edges),
    }
    sweep = {}
    for name, (launch, rows, num_edges) in cases.items():
        timings = {}
        for cfg in CONFIGS:
            try:
                timings[str(cfg)] = round(_time(lambda: launch(cfg)), 3)
            except Exception as exc:  # a configuration the compiler rejects (registers, shared memory)
                timings[str(cfg)] = f"{type(exc).__name__}: {str(exc)[:120]}"
        sweep[name] = dict(rows=rows, edges_per_row=round(num_edges / rows, 1), ms=timings)
        print(json.dumps({"case": name, **sweep[name]}), flush=True)

    best = {}
    for kind in ("short", "long"):
        names = [n for n, (_, rows, num_edges) in cases.items() if (num_edges >= em.LONG_ROWS * rows) == (kind == "long")]
        totals = {str(cfg): sum(sweep[n]["ms"][str(cfg)] for n in names) for cfg in CONFIGS
                  if all(isinstance(sweep[n]["ms"][str(cfg)], float) for n in names)}
        if names and totals:
            best[kind] = min(totals, key=totals.get)
            print(json.dumps({"kind": kind, "cases": names, "best": best[kind], "ms": totals[best[kind]],
                              "default_ms": totals.get(str(em.KERNEL_CONFIGS[kind]))}), flush=True)

    # torch's message sum on the same inputs, forward and forward + backward, for comparison
    def torch_sum(a, sums, backward):
        a_, b_, bias_ = (t.detach().requires_grad_(backward) for t in (a, b, bias))
        out = em.aggregate_edge_messages(a_, b_, sums, bias_, "torch")
        if backward:
            torch.autograd.grad(out, (a_, b_, bias_), grad_out)

    for name, a, sums in (("layer 1", a1, first), ("layer 2", a2, later)):
        print(json.dumps({"torch sum": name, "forward_ms": round(_time(lambda: torch_sum(a, sums, False)), 3),
                          "forward_backward_ms": round(_time(lambda: torch_sum(a, sums, True)), 3),
                          "sort_ms": round(sort_ms, 3)}), flush=True)

    # the whole extractor, forward + backward, bf16 autocast
    x = torch.randn(nodes, d, device=dev, generator=gen)
    edge_attr = torch.randn(edges, d, device=dev, generator=gen)
    sub = {k: batch[k] for k in SUBGRAPH_KEYS}
    runs = [("torch", "torch", None), ("fused, default configs", "fused", None)]
    if best:
        by_name = {str(cfg): cfg for cfg in CONFIGS}
        runs.append(("fused, picked configs", "fused", {k: by_name[v] for k, v in best.items()}))
    defaults = dict(em.KERNEL_CONFIGS)
    for label, impl, configs in runs:
        em.KERNEL_CONFIGS.update(configs or defaults)
        ext = SubgraphExtractor(d, "gcn", 2, d, message_impl=impl).to(dev)
        xi, ei = x.clone().requires_grad_(), edge_attr.clone().requires_grad_()

        def step():
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                out = ext(xi, batch.edge_index, ei, **sub)
            out.float().sum().backward()

        step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
        ms = _time(step)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if dev.type == "cuda" else float("nan")
        print(json.dumps({"extractor": label, "configs": dict(em.KERNEL_CONFIGS), "fwd_bwd_ms": round(ms, 2),
                          "peak_gib": round(peak, 3)}), flush=True)
    em.KERNEL_CONFIGS.update(defaults)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
