"""runtime/ray_private.py: the only module that uses Ray's non-public API, each use still there in the
installed Ray, and no other module of satp importing Ray's private modules."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import ray

from runtime import ray_private

ROOT = Path(__file__).resolve().parents[1]
PRIVATE = ("ray._private", "ray._raylet", "ray.core.generated", "ray.train.v2._internal")
PACKAGES = ("sat", "preprocessing", "pipeline", "runtime")


def _missing(what: str) -> str:
    return (f"Ray {ray.__version__} no longer has {what} (runtime/ray_private.py was tested on Ray "
            f"{', '.join(ray_private.TESTED_ON)}): satp falls back to Ray's plain behaviour there; "
            "update runtime/ray_private.py and pyproject.toml's ray pin")


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def test_the_installed_ray_is_one_the_private_uses_were_tested_on():
    assert ray.__version__.startswith(ray_private.TESTED_ON), _missing(f"the version pinned ({ray.__version__})")


def test_the_failure_signal_handler_setting_is_still_there():
    from ray._private import ray_constants

    saved = getattr(ray_constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER", None)
    try:
        assert ray_private.disable_failure_signal_handler(), _missing("ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER")
    finally:
        if saved is not None:
            ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = saved


def test_the_driver_s_log_printing_handler_is_still_there():
    try:
        from ray._private.worker import global_worker_stdstream_dispatcher
    except ImportError:
        pytest.fail(_missing("ray._private.worker.global_worker_stdstream_dispatcher"))
    assert callable(getattr(global_worker_stdstream_dispatcher, "remove_handler", None)), \
        _missing("global_worker_stdstream_dispatcher.remove_handler")
    assert callable(getattr(global_worker_stdstream_dispatcher, "add_handler", None))
    global_worker_stdstream_dispatcher.add_handler("ray_print_logs", lambda data: None)
    assert ray_private.stop_printing_cluster_logs()


def test_satp_s_trainer_still_drops_the_unused_callbacks_and_takes_sigint():
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    seen = []
    trainer_class = ray_private.trainer_class(on_sigint=seen.append)
    assert trainer_class is not TorchTrainer, _missing("Ray Train's internal callbacks (ray.train.v2._internal.callbacks)")
    trainer = trainer_class(lambda: None, scaling_config=ScalingConfig(num_workers=1))
    names = {type(cb).__name__ for cb in trainer._create_default_callbacks()}
    assert not names & {"PlacementGroupCleanerCallback", "DatasetsCallback"}, names
    assert names, _missing("TorchTrainer._create_default_callbacks")
    trainer._register_sigint_handler("controller")
    assert seen == ["controller"], _missing("TorchTrainer._register_sigint_handler")


def test_no_other_module_imports_ray_s_private_modules():
    found = [f"{path.relative_to(ROOT)}: {name}" for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
             if path != ROOT / "runtime" / "ray_private.py"
             for name in _imports(path) if name.startswith(PRIVATE)]
    assert not found, "Ray's private modules imported outside runtime/ray_private.py: " + "; ".join(found)


def test_at_most_three_private_uses():
    uses = [name for name in dir(ray_private) if not name.startswith("_") and callable(getattr(ray_private, name))
            and getattr(getattr(ray_private, name), "__module__", "") == ray_private.__name__]
    assert sorted(uses) == ["disable_failure_signal_handler", "stop_printing_cluster_logs", "trainer_class"]
