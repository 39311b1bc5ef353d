"""Check that the wheel kit (make_wheels.sh + install_kit.sh) gives the pipeline what it imports.

    python benchmarks/gpu/kit_check.py [--workdir /tmp/kitcheck] [--gpu]

Runs, in about a minute: the imports of ray, deepspeed, mlflow, ogb, pydantic (and where they
come from); ``ray.init(include_dashboard=False)`` (``--dashboard``: with it) and a 1-worker ``ray.train.torch.TorchTrainer``
fit that reports a metric and a checkpoint (on the GPU with ``--gpu``); a Ray Tune run of two
trials; ``ogb``'s ``Evaluator('ogbg-code2')``; an MLflow SQLite store with a run, metrics, an
artifact, a pytorch model (``serialization_format="pickle"``), a registered version with an alias,
loaded back by ``models:/NAME@ALIAS``. Prints one line per check; exits non-zero on the first
failure.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OUTDATED_IGNORE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def step(name):
    def wrap(fn):
        def run(*args, **kwargs):
            t = time.perf_counter()
            detail = fn(*args, **kwargs)
            print(f"ok   {name:<24} {time.perf_counter() - t:6.1f} s  {detail or ''}", flush=True)

        return run

    return wrap


@step("imports")
def check_imports() -> str:
    import importlib

    out = []
    for name in ("ray", "deepspeed", "mlflow", "ogb", "pydantic", "torch", "torch_geometric"):
        mod = importlib.import_module(name)
        out.append(f"{name} {getattr(mod, '__version__', '?')} ({Path(mod.__file__).parent.parent})")
    return "; ".join(out)


def _train_loop(config):
    import tempfile as tf

    import torch

    import ray.train
    import ray.train.torch

    device = ray.train.torch.get_device()
    model = ray.train.torch.prepare_model(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(64, 4, device=device), torch.randn(64, 1, device=device)
    for epoch in range(2):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with tf.TemporaryDirectory() as tmp:
            torch.save(model.state_dict(), os.path.join(tmp, "model.pt"))
            ray.train.report({"epoch": epoch, "loss": float(loss.detach())},
                             checkpoint=ray.train.Checkpoint.from_directory(tmp))


@step("ray train")
def check_ray_train(workdir: Path, gpu: bool) -> str:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        _train_loop,
        scaling_config=ScalingConfig(num_workers=1, use_gpu=gpu),
        run_config=RunConfig(name="kit-check", storage_path=str(workdir / "ray")),
    )
    result = trainer.fit()
    return f"1 worker (gpu={gpu}): loss {result.metrics['loss']:.3f}, checkpoint {result.checkpoint is not None}"


def _trainable(config):
    from ray import tune

    for i in range(2):
        tune.report({"score": config["x"] * (i + 1)})


@step("ray tune")
def check_ray_tune(workdir: Path) -> str:
    from ray import tune

    tuner = tune.Tuner(
        _trainable,
        param_space={"x": tune.grid_search([1, 2])},
        tune_config=tune.TuneConfig(metric="score", mode="max"),
        run_config=tune.RunConfig(name="kit-tune", storage_path=str(workdir / "tune"), verbose=0),
    )
    best = tuner.fit().get_best_result()
    return f"2 trials, best score {best.metrics['score']}"


@step("ogb evaluator")
def check_ogb() -> str:
    from ogb.graphproppred import Evaluator

    ev = Evaluator("ogbg-code2")
    res = ev.eval({"seq_ref": [["get", "name"]], "seq_pred": [["get", "name"]]})
    return f"ogbg-code2 {res}"


@step("mlflow sqlite+registry")
def check_mlflow(workdir: Path) -> str:
    import mlflow
    import torch
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("kit-check", artifact_location=(workdir / "mlartifacts").as_uri())
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    note = workdir / "note.txt"
    note.write_text("hello")
    with mlflow.start_run(experiment_id=exp) as run:
        mlflow.log_params({"a": 1, "b": "x"})
        mlflow.log_metrics({"loss": 0.5, "acc": 0.9}, step=1)
        mlflow.log_artifact(str(note))
        info = mlflow.pytorch.log_model(model, name="model", serialization_format="pickle",
                                        pip_requirements=["torch"])
    version = mlflow.register_model(info.model_uri, "kit-model")
    client.set_registered_model_alias("kit-model", "champion", version.version)
    loaded = mlflow.pytorch.load_model("models:/kit-model@champion", map_location="cpu")
    x = torch.randn(2, 4)
    same = torch.allclose(model(x), loaded(x))
    metrics = client.get_run(run.info.run_id).data.metrics
    return f"run {run.info.run_id[:8]}, metrics {sorted(metrics)}, version {version.version}@champion, reloaded equal={same}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--gpu", action="store_true", help="the Train worker takes a GPU")
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--dashboard", action="store_true",
                    help="start Ray with its dashboard on 127.0.0.1 (as `satp train` does)")
    args = ap.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kitcheck-"))
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    check_imports()
    check_ogb()
    check_mlflow(workdir)
    import ray

    t = time.perf_counter()
    extra = {"dashboard_host": "127.0.0.1"} if args.dashboard else {}
    ray.init(address="local", include_dashboard=args.dashboard, num_cpus=args.num_cpus,
             num_gpus=1 if args.gpu else 0, **extra)
    print(f"ok   {'ray.init':<24} {time.perf_counter() - t:6.1f} s  {ray.cluster_resources()}", flush=True)
    try:
        check_ray_train(workdir, args.gpu)
        check_ray_tune(workdir)
    finally:
        ray.shutdown()
    print("kit_check: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
