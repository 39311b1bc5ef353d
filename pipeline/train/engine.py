"""The DeepSpeed engine of a worker: precision, ZeRO stage, clipping, AdamW and the schedule.

Mixed precision is DeepSpeed's ``torch_autocast`` (bf16 where supported, else fp16 with a scaler, or
fp32). At ZeRO stage 0 without the fp16 scaler, gradients are clipped here with one foreach norm
(:func:`optimizer_step`) and the step reduces once (:meth:`pipeline.train.step.TrainStep.finish`).
"""
from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Any

import torch

from pipeline.config.train import TrainConfig


def resolve_precision(precision: str, use_gpu: bool) -> str:
    """``auto`` -> ``bf16`` where supported, else ``fp16`` on GPU, ``fp32`` on CPU."""
    if precision != "auto":
        if precision == "fp16" and not use_gpu:
            raise ValueError("train.precision: fp16 is not supported on CPU (DeepSpeed rejects it); use bf16 or fp32")
        return precision
    if use_gpu:
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp16"
    try:
        with open("/proc/cpuinfo") as fh:
            flags = fh.read()
    except OSError:
        return "fp32"
    return "bf16" if "avx512_bf16" in flags or "amx_bf16" in flags else "fp32"


def accumulation_steps(train: TrainConfig, world_size: int) -> int:
    """DeepSpeed's ``gradient_accumulation_steps``: 1 at ZeRO stage 0 (satp accumulates and reduces
    itself), else every rank's share of a step, which must then be equal."""
    if train.zero_stage == 0:
        return 1
    k = train.micro_batches_per_step or world_size
    if k % world_size:
        raise ValueError(f"train.zero_stage {train.zero_stage} needs every worker to take the same share of a step: "
                         f"train.micro_batches_per_step {k} is not a multiple of {world_size} workers")
    return k // world_size


def deepspeed_config(train: TrainConfig, precision: str, world_size: int) -> dict[str, Any]:
    gas = accumulation_steps(train, world_size)
    config: dict[str, Any] = {
        # batches are built to a node budget, so DeepSpeed's batch size is nominal
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gas,
        "train_batch_size": world_size * gas,
        "zero_optimization": {"stage": train.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
    }
    # always explicit: DeepSpeed clips at 1.0 when the key is absent
    clip_here = clips_outside_deepspeed(train, precision)
    config["gradient_clipping"] = 0.0 if clip_here else float(train.grad_clip)
    if precision in ("bf16", "fp16"):
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16" if precision == "bf16" else "float16"}
    return config


def warmup_cosine(total_steps: int, warmup_steps: int, min_ratio: float = 0.0, cosine: bool = True):
    """Multiplier of the base lr at optimizer step ``step`` (LambdaLR semantics)."""
    total_steps = max(1, int(total_steps))
    warmup_steps = max(0, min(int(warmup_steps), total_steps))

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if not cosine:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def warmup_inverse_sqrt(warmup_steps: int):
    """The Transformer's schedule (Vaswani et al., 2017), scaled to peak at the base lr, as a
    multiplier of it at optimizer step ``step`` (LambdaLR semantics). With ``s = step + 1`` and
    ``w = warmup_steps`` it is ``s / w`` during the warm-up and ``sqrt(w / s)`` after it. The SAT
    authors used it on ZINC, PATTERN and CLUSTER (paper, appendix; ``lr_scheduler`` in their
    ``train_SBMs.py``: a linear ramp from 1e-6, then ``lr * sqrt(w / s)``)."""
    w = max(1, int(warmup_steps))

    def factor(step: int) -> float:
        s = step + 1
        return s / w if s < w else math.sqrt(w / s)

    return factor


def lr_schedule(train: TrainConfig, steps_per_epoch: int):
    """The job's schedule (``train.scheduler``) as a LambdaLR multiplier. The warm-up is
    ``train.warmup_steps`` if set, else ``train.warmup_epochs`` epochs."""
    warmup = train.warmup_steps if train.warmup_steps is not None else round(steps_per_epoch * train.warmup_epochs)
    if train.scheduler == "inverse_sqrt":
        return warmup_inverse_sqrt(warmup)
    return warmup_cosine(steps_per_epoch * train.epochs, warmup, train.min_lr_ratio, cosine=train.scheduler == "cosine")


def clips_outside_deepspeed(train: TrainConfig, precision: str) -> bool:
    """Whether :func:`optimizer_step` clips the gradients itself (whole, unscaled gradients on
    every rank: ZeRO stage 0 without the fp16 gradient scaler)."""
    return train.zero_stage == 0 and precision != "fp16"


def skip_deepspeed_jit_ops() -> None:
    """Mark DeepSpeed's CPU shared-memory communication op unavailable, so that its CPU accelerator
    does not JIT-compile it: it serves only DeepSpeed inference; training all-reduces go through gloo."""
    if os.environ.get("DS_ACCELERATOR", "cpu") != "cpu":
        return
    with contextlib.suppress(ImportError, AttributeError, TypeError):
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def build_model(config) -> torch.nn.Module:
    """The SAT model of a :class:`sat.config.SATConfig`."""
    import sat

    from pipeline import pyg_templates

    pyg_templates.install()  # generated PyG modules stay in memory in every process that builds a model

    return sat.SAT(config)


def build_engine(model: torch.nn.Module, train: TrainConfig, precision: str, steps_per_epoch: int, world_size: int,
                 compile_model: bool = False):
    """``deepspeed.initialize`` with AdamW and the job's lr schedule (:func:`lr_schedule`); returns the
    engine. ``compile_model``: ``engine.compile`` (``torch.compile`` in place, ``dynamic=False``)."""
    import deepspeed

    skip_deepspeed_jit_ops()
    on_cuda = next(model.parameters()).is_cuda or os.environ.get("DS_ACCELERATOR") == "cuda"
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=train.lr, weight_decay=train.weight_decay, **({"fused": True} if on_cuda else {})
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(train, steps_per_epoch))
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=deepspeed_config(train, precision, world_size),
    )
    if train.zero_stage == 0 or world_size == 1:
        engine.enable_backward_allreduce = False  # reduced once per step (see the module docstring), or alone
    if compile_model:
        engine.compile(compile_kwargs={"dynamic": False})
    return engine


def optimizer_step(engine, grad_clip: float, clip_here: bool) -> None:
    """Clip (when this module owns clipping, see :func:`clips_outside_deepspeed`) and step the
    engine: optimizer, zeroed gradients, lr schedule. Reads nothing back from the device."""
    if clip_here and grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(engine.module.parameters(), grad_clip)  # foreach where supported
    engine.step()


def keep_compile_caches(storage_path: str) -> None:
    """Point Inductor's and Triton's caches at ``<storage_path>/.satp-compile-cache``, so that a rerun
    loads the compiled kernels instead of compiling again (storage behind a URI keeps the defaults)."""
    if "://" in storage_path:
        return
    root = Path(storage_path) / ".satp-compile-cache"
    for variable, name in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
        os.environ[variable] = str(root / name)
