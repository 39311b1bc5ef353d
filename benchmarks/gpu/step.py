"""GPU train-step benchmark through the project's own parts: one configuration per process.

``python -m benchmarks.gpu.step '<json spec>'`` prints one JSON line of figures. The step is the
worker's (:class:`pipeline.train.step.TrainStep` on a :func:`pipeline.train.engine.build_engine`
DeepSpeed engine, single rank), fed by the worker's loader (:class:`pipeline.train.batching.NodeBudgetSampler`,
:class:`pipeline.train.loader.BatchCollator` in DataLoader worker processes, pinned memory,
non-blocking copies), on the model of ``jobs/code2.yaml`` configured by :class:`pipeline.tasks.Code2Task`
(or the job named in the spec, with its task). Figures:

* ``graphs_per_s``: graphs trained per second of wall clock over a window of whole steps after
  warm-up (synchronised at the window's ends only), and ``data_wait_frac``, the share of that
  window the loop waited for the loader;
* ``breakdown``: over a few further steps, host time of each phase (what the Python side costs
  per step: forward, loss, backward, optimizer) and its GPU time (CUDA events, the device
  synchronised after each step so that phases do not overlap), and the host synchronisations
  per step (``torch.cuda.set_sync_debug_mode``);
* ``profile``: kernels launched and GPU busy time per step (``torch.profiler``);
* ``flops_per_graph`` (``torch.utils.flop_counter`` over the matmuls, the packed attention's
  ``12 * sum_g n_g^2 * d`` per layer added analytically: its kernel is not counted) and
  ``mfu``, the model FLOP utilisation against the card's dense peak for the precision;
* ``peak_mem_gb``: ``torch.cuda.max_memory_allocated``.

Spec keys: ``precision`` (bf16 | fp32), ``extractor`` (subtree | subgraph), ``attention``,
``gnn_messages`` (auto | fused | torch: the GCN message sums, :mod:`sat.edge_messages`),
``recompute_gnn`` (rerun the extractors' GNN in the backward pass),
``node_budget``, ``max_graphs`` (graphs per batch cap), ``bucket_size`` (the sampler's sorted
buckets; ``bucket_size = max_graphs`` gives random batches, as the SAT authors' loader),
``seconds`` (timed window), ``warmup`` (steps), ``loader_workers``, ``compile``
(``torch.compile(dynamic=True)`` the model), ``detail`` (default true: phases, profile, FLOPs),
``top_ops`` (with ``detail``: the profile's top operators by device and by host time), ``step``
(``train.step``: eager | static | compiled | captured, :mod:`pipeline.train.step`; batch capacities
from the sampler's first epoch; ``warmup_s`` then includes compilation and capture), ``tiny``
(a small model, for dry runs on a CPU), ``graphs`` (a file written by :func:`save_graphs`) or
``shards`` (a shard directory: its train split), ``job`` (default ``jobs/code2.yaml``), ``in_ray``
(measure inside a one-worker Ray Train ``TorchTrainer``, where ``satp train`` runs its steps).
``host_cpu_per_step_ms`` is the CPU time of the measuring process (all its threads) per step.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: dense peak FLOP/s by card name fragment: (bf16 tensor cores, fp32 without TF32)
PEAK_FLOPS = {"H200": (989e12, 67e12), "H100 PCIe": (756e12, 51e12), "H100": (989e12, 67e12), "A100": (312e12, 19.5e12)}


def save_graphs(graphs: list, path: str | Path) -> None:
    """Write ``SATData`` graphs as a few plain tensors (read back with ``weights_only=True``).

    Each field is concatenated over the graphs along the dimension batching concatenates, with the
    graphs' lengths: one storage per field, so that every benchmark process loads the file in well
    under a second (a storage per graph and field took ~14 s for 16k graphs).
    """
    import torch

    keys = [k for k, v in graphs[0].items() if torch.is_tensor(v)]
    fields = {}
    for key in keys:
        dim = graphs[0].__cat_dim__(key, graphs[0][key]) % graphs[0][key].dim()
        parts = [g[key] for g in graphs]
        fields[key] = {"dim": dim, "values": torch.cat(parts, dim),
                       "lengths": torch.tensor([t.size(dim) for t in parts], dtype=torch.int64)}
    torch.save({"num_nodes": torch.tensor([int(g.num_nodes) for g in graphs]), "fields": fields}, path)


def load_graphs(path: str | Path) -> list:
    import torch

    from sat.data import SATData

    stored = torch.load(path, weights_only=True)
    columns = {key: torch.split(f["values"], f["lengths"].tolist(), dim=f["dim"]) for key, f in stored["fields"].items()}
    return [SATData(num_nodes=n, **{key: parts[i] for key, parts in columns.items()})
            for i, n in enumerate(stored["num_nodes"].tolist())]


def peak_flops(precision: str) -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, (bf16, fp32) in PEAK_FLOPS.items():
        if key in name:
            return bf16 if precision == "bf16" else fp32
    return None


def _setup_single_rank(device) -> None:
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ["DS_ACCELERATOR"] = device.type


class _Device:
    """The CUDA calls of the measurement, with CPU stand-ins for a dry run on a machine without GPU."""

    def __init__(self) -> None:
        import torch

        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        if self.cuda:
            torch.cuda.set_device(self.device)

    def sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak_gb(self) -> float:
        import resource

        import torch

        if self.cuda:
            return torch.cuda.max_memory_allocated() / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

    def sync_debug(self, mode) -> None:
        import torch

        if self.cuda:
            torch.cuda.set_sync_debug_mode(mode)

    def event(self):
        import torch

        return torch.cuda.Event(enable_timing=True) if self.cuda else _HostEvent()

    def name(self) -> str:
        import torch

        return torch.cuda.get_device_name() if self.cuda else "cpu (dry run)"


class _HostEvent:
    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, other: "_HostEvent") -> float:
        return 1000.0 * (other.t - self.t)


def _job_parts(spec: dict, dataset):
    """The job's task, its model config (configured by the task) and train config, with the spec's overrides.

    The task is the job's (``train.task``, else the dataset's default), as the worker builds it; a
    code2 task on synthetic graphs gets a made-up vocabulary of the job's size (shards carry their own).
    """
    import dataclasses

    from pipeline.config import load_job
    from pipeline.tasks import make_task, task_name_for

    job = load_job(ROOT / spec.get("job", "jobs/code2.yaml"))
    vocab = getattr(dataset, "vocab", None) or [f"tok{i}" for i in range(job.transform.vocab_size)] + ["__UNK__", "__EOS__"]
    task = make_task(task_name_for(job.train.task, job.data.name), vocab=vocab)
    model = job.model
    overrides = {"extractor": spec.get("extractor", model.extractor), "attention": spec.get("attention", "auto"),
                 "gnn_messages": spec.get("gnn_messages", "auto"), "recompute_gnn": spec.get("recompute_gnn", False)}
    if spec.get("tiny"):  # dry runs on a CPU: the same code paths, a small model
        overrides.update(hidden_dim=32, num_layers=1)
    config = task.configure(dataclasses.replace(model, **overrides), dataset[0])
    update = {"node_budget": spec["node_budget"], "max_graphs_per_batch": spec.get("max_graphs")}
    if spec.get("bucket_size"):  # e.g. the reference's random batches: buckets of one batch, unsorted
        update["bucket_size"] = spec["bucket_size"]
    train = job.train.model_copy(update=update)
    return task, config, train


def _attention_flops(layout, hidden_dim: int, num_layers: int) -> float:
    """Forward (4) + backward (8) FLOPs of exact attention, ``sum_g n_g^2 * d`` each, per layer."""
    sq = float((layout.sizes.astype("float64") ** 2).sum())
    return 12.0 * sq * hidden_dim * num_layers


def _flops_per_graph(model, task, batches: list, device) -> float:
    """Model FLOPs of a training step (forward + backward), per graph, over ``batches``.

    Counted with the packed attention in bf16 (FLOPs do not depend on the precision): its kernel
    is not counted by the FLOP counter, so exact attention is added analytically. Without that
    kernel (a CPU dry run) the padded SDPA is counted, padding included.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from sat.attention import varlen_available

    packed = device.type == "cuda" and varlen_available()
    model.set_attention("varlen" if packed else "dense")
    total, graphs = 0.0, 0
    try:
        for batch in batches:
            batch = batch.to(device)
            counter = FlopCounterMode(display=False)
            with counter, torch.autocast(device.type, dtype=torch.bfloat16, enabled=packed):
                loss = task.loss(model(batch, validate=False), batch)
                loss.backward()
            model.zero_grad(set_to_none=True)
            cfg = model.config
            total += counter.get_total_flops()
            if packed:
                total += _attention_flops(batch.graph_layout, cfg.hidden_dim, cfg.num_layers)
            graphs += batch.num_graphs
    finally:
        model.set_attention(model.config.attention)
    return total / max(graphs, 1)


def measure(spec: dict) -> dict:
    import numpy as np
    import torch

    dev = _Device()
    device = dev.device
    _setup_single_rank(device)
    from pipeline.train.batching import NodeBudgetSampler
    from pipeline.train.capacity import choose_capacity, describe, graph_sizes
    from pipeline.train.engine import build_engine, clips_outside_deepspeed
    from pipeline.train.loader import BatchCollator, make_loader, open_split
    from pipeline.train.step import TrainStep, compiles_model, pads_batches
    from sat import SAT
    from sat.edge_messages import resolve_impl as resolve_messages
    from sat.padding import padding_of

    torch.manual_seed(0)
    dataset = load_graphs(spec["graphs"]) if spec.get("graphs") else open_split(spec["shards"], "train")
    sizes = np.asarray([g.num_nodes for g in dataset] if spec.get("graphs") else dataset.num_nodes)
    task, config, train = _job_parts(spec, dataset)
    model = SAT(config)
    if spec.get("compile"):
        model.compile(dynamic=True)  # in place: parameter names unchanged
    precision = spec["precision"]
    mode = spec.get("step", "eager")
    sampler = NodeBudgetSampler(sizes, train.node_budget, seed=0, max_graphs=train.max_graphs_per_batch,
                                bucket_size=train.bucket_size)
    capacity = None
    if pads_batches(mode):
        capacity = choose_capacity(sampler.global_batches(0), graph_sizes(dataset, config.needs_subgraphs),
                                   train.capacity_sigmas)
    engine = build_engine(model, train, precision, len(sampler), 1, compile_model=compiles_model(mode))
    step = TrainStep(engine, task, train.grad_clip, clips_outside_deepspeed(train, precision), mode=mode, device=device)
    collator = BatchCollator(config, capacity=capacity, node_targets=task.node_level)
    loader = make_loader(dataset, sampler, collator, spec.get("loader_workers", 4), pin_memory=dev.cuda)
    engine.train()

    def batches():
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    stream = batches()
    warmup_start = time.perf_counter()  # with compile and capture (their first batches)
    for _ in range(spec.get("warmup", 20)):
        step(next(stream))
    dev.sync()
    warmup_s = time.perf_counter() - warmup_start
    dev.reset_peak()
    step.overflow = 0

    # -- throughput window
    graphs = nodes = steps = 0
    wait = 0.0
    cpu_start = time.process_time()  # this process, all threads (not the loader's worker processes)
    start = time.perf_counter()
    while time.perf_counter() - start < spec.get("seconds", 8.0) or steps < 5:
        t = time.perf_counter()
        cpu_batch = next(stream)
        wait += time.perf_counter() - t
        step(cpu_batch)  # the step moves it (pinned, without blocking)
        padding = padding_of(cpu_batch)
        graphs += padding.graphs if padding is not None else cpu_batch.num_graphs
        nodes += padding.nodes if padding is not None else cpu_batch.num_nodes
        steps += 1
    dev.sync()
    window = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    peak_mem = dev.peak_gb()

    gps = graphs / window
    result = {
        "graphs_per_s": gps,
        "step_ms": 1000 * window / steps,
        "graphs_per_step": graphs / steps,
        "nodes_per_step": nodes / steps,
        "steps": steps,
        "window_s": window,
        "data_wait_frac": wait / window,
        "host_cpu_per_step_ms": 1000 * cpu_seconds / steps,
        "peak_mem_gb": peak_mem,
        "device": dev.name(),
        "torch": torch.__version__,
        "step_mode": mode,
        "capacity": describe(capacity),
        "overflow_share": step.overflow / steps,
        "warmup_s": warmup_s,
        "attention_impl": engine.module.layers[0].attn.resolve_impl(
            torch.empty(1, device=device, dtype=torch.bfloat16 if precision == "bf16" else torch.float32)),
        "gnn_messages": resolve_messages(engine.module.config.gnn_messages, device),
    }
    if spec.get("detail", True):
        clip_here = clips_outside_deepspeed(train, precision)
        parts = [("profile", lambda: _profile(dev, step, stream, top=spec.get("top_ops", 0)))]
        if mode == "eager":  # the phases call the engine directly: an eager step's parts
            parts.insert(0, ("phases", lambda: _phases(dev, engine, task, stream, train.grad_clip, clip_here)))
        if not spec.get("compile") and mode == "eager":  # counting would compile another graph
            parts.append(("flops", lambda: _mfu(engine.module, task, stream, device, precision, gps)))
        for name, part in parts:
            try:  # a failed detail must not lose the throughput figures
                result.update(part())
            except Exception as exc:
                result[f"{name}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return result


def _mfu(model, task, stream, device, precision: str, graphs_per_s: float) -> dict:
    flops = _flops_per_graph(model, task, [next(stream) for _ in range(3)], device)
    peak = peak_flops(precision)
    return {"flops_per_graph": flops, "mfu": flops * graphs_per_s / peak if peak else None}


def _phases(dev: _Device, engine, task, stream, grad_clip: float, clip_here: bool, steps: int = 4) -> dict:
    """Per phase: host time (the Python side, no syncs) and GPU time (CUDA events, the device
    synchronised after each step so that phases do not overlap); host syncs per step."""
    from pipeline.train.engine import optimizer_step
    from pipeline.train.loader import to_device

    phases = ("forward", "loss", "backward", "optimizer")
    host: dict[str, list[float]] = {p: [] for p in phases}
    gpu: dict[str, list[float]] = {p: [] for p in phases}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            batch = to_device(next(stream), dev.device)
            events = [dev.event() for _ in range(len(phases) + 1)]
            dev.sync_debug("warn")  # counts the step's own syncs, not ours below
            marks = [time.perf_counter()]
            events[0].record()
            out = engine(batch, validate=False)
            marks.append(time.perf_counter())
            events[1].record()
            loss = task.loss(out, batch)
            marks.append(time.perf_counter())
            events[2].record()
            engine.backward(loss)
            marks.append(time.perf_counter())
            events[3].record()
            optimizer_step(engine, grad_clip, clip_here)
            marks.append(time.perf_counter())
            events[4].record()
            dev.sync_debug(0)
            dev.sync()
            for i, p in enumerate(phases):
                host[p].append(marks[i + 1] - marks[i])
                gpu[p].append(events[i].elapsed_time(events[i + 1]) / 1000.0)
    # (setting the debug mode warns that it is a prototype: not a sync)
    syncs = [w for w in caught if "synchronizing CUDA operation" in str(w.message)]
    return {
        "host_ms": {p: 1000 * statistics.median(v) for p, v in host.items()},
        "gpu_ms": {p: 1000 * statistics.median(v) for p, v in gpu.items()},
        "host_syncs_per_step": len(syncs) / steps,
        "sync_sources": sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs})[:5],
    }


def _profile(dev: _Device, step, stream, steps: int = 3, top: int = 0) -> dict:
    """Kernels launched, GPU busy time and stream synchronisations per step (torch.profiler); with
    ``top``, the operators that take the most device time and the most host time, per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step(next(stream))
        dev.sync()
    events = prof.events()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    out = {
        "kernels_per_step": len(kernels) / steps,
        "gpu_busy_ms_per_step": sum(e.time_range.elapsed_us() for e in kernels) / 1000 / steps,
        "stream_syncs_per_step": sum(e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize") for e in events) / steps,
    }
    if top:
        table = prof.key_averages()

        def rows(key):
            ranked = sorted(table, key=key, reverse=True)[:top]
            return [(e.key[:80], round(e.count / steps, 1), round(e.self_device_time_total / 1000 / steps, 2),
                     round(e.self_cpu_time_total / 1000 / steps, 2)) for e in ranked]

        # (name, calls, self device ms, self host ms) per step
        out["top_device_ops"] = rows(lambda e: e.self_device_time_total)
        out["top_host_ops"] = rows(lambda e: e.self_cpu_time_total)
    return out


def measure_in_ray_worker(spec: dict) -> dict:
    """:func:`measure` inside a one-worker Ray Train ``TorchTrainer`` (the process and thread a
    ``satp train`` step runs in), on a local Ray cluster: separates what the worker's environment
    costs from what the worker's loop costs."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    def train_fn(config: dict) -> None:
        Path(config["out"]).write_text(json.dumps(measure(config["spec"])))

    use_gpu = _Device().cuda
    cpus = min(spec.get("loader_workers", 4) + 2, os.cpu_count() or 1)  # the job's cpus_per_worker
    work = Path(tempfile.mkdtemp(prefix="satp-step-ray-"))
    ray.init(include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        TorchTrainer(
            train_fn, train_loop_config={"spec": spec, "out": str(work / "result.json")},
            scaling_config=ScalingConfig(num_workers=1, use_gpu=use_gpu, resources_per_worker={"CPU": cpus}),
            run_config=RunConfig(storage_path=str(work)),
        ).fit()
        return json.loads((work / "result.json").read_text()) | {"in_ray_worker": True}
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    spec = json.loads(sys.argv[1])
    print(json.dumps(measure_in_ray_worker(spec) if spec.pop("in_ray", False) else measure(spec)))
