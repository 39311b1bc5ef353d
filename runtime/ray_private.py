"""Every use satp makes of Ray's non-public modules, each with its reason and a fall-back.

Ray documents no way to do these three things. Each use is checked against the installed Ray by
tests/test_ray_private.py, which fails naming the use when a Ray release no longer has it; at run
time a missing one falls back to Ray's plain behaviour (said in the function). No other module of
satp imports ``ray._private``, ``ray._raylet``, ``ray.core.generated`` or ``ray.train.v2._internal``.
"""
from __future__ import annotations

from typing import Callable, Optional

#: the Ray releases these uses were tested on (pyproject.toml pins ray to them)
TESTED_ON = ("2.60",)


def disable_failure_signal_handler() -> bool:
    """Keep the next ``ray.init`` of this process from installing the core worker's failure-signal
    handler (``ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER``, read when the core worker starts).
    Why: that handler takes SIGTERM too until satp's own (:mod:`runtime.interrupts`) replaces it; a
    SIGTERM while a command connects printed a stack dump of every thread, and the alarm it sets
    aborted the command three seconds later (status -6) in the middle of its clean-up. Returns False
    where the setting is gone: Ray's handler stays (a SIGTERM meanwhile prints its dump)."""
    try:
        from ray._private import ray_constants
    except ImportError:
        return False
    if not hasattr(ray_constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"):
        return False
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    return True


def stop_printing_cluster_logs() -> bool:
    """Stop printing the cluster's forwarded worker logs in this driver (Ray's
    ``global_worker_stdstream_dispatcher`` handler ``ray_print_logs``, which ``ray.shutdown`` removes
    too). Why: after an interrupt they are the run's actors going down (tracebacks that tell the user
    nothing) printed after satp's last line. Returns False where it is gone: those lines still print."""
    try:
        from ray._private.worker import global_worker_stdstream_dispatcher

        global_worker_stdstream_dispatcher.remove_handler("ray_print_logs")
    except (ImportError, AttributeError, KeyError):
        return False
    return True


def trainer_class(on_sigint: Optional[Callable[[object], None]] = None) -> type:
    """Ray Train's ``TorchTrainer`` as satp's runs use it; the plain ``TorchTrainer`` where Ray's
    internals moved (its own SIGINT handling, and two more actors per run, come back).

    * ``on_sigint(controller)`` replaces the SIGINT handler ``fit`` installs (it aborts the run, logs
      the controller's tracebacks and exits with status 0): satp's handler unwinds the driver so that
      it says what was kept, and keeps the controller referenced until Ray is shut down.
    * The controller starts no actor that a satp run has no use for, each a process of its own (~2.3 s
      of CPU, ~0.2 GB) started while the workers import: Ray Data's ``DatasetManager`` (its
      ``DatasetsCallback`` starts one per worker group even without datasets; satp's workers read their
      Arrow shards themselves) and the detached ``PlacementGroupCleaner``, which removes the workers'
      placement group should the controller die while its job goes on. Here the job is the command
      (Ray removes a job's placement groups when it ends) or a sweep, which releases the groups of its
      ended trials itself; the cleaner asked the State API every second and outlived interrupted runs.
    """
    from ray.train.torch import TorchTrainer

    if not all(hasattr(TorchTrainer, name) for name in ("_register_sigint_handler", "_create_default_callbacks")):
        return TorchTrainer

    class SatpTrainer(TorchTrainer):
        def _register_sigint_handler(self, controller) -> None:
            if on_sigint is None:
                super()._register_sigint_handler(controller)
            else:
                on_sigint(controller)

        def _create_default_callbacks(self) -> list:
            # by name, not by importing Ray Train's internal modules: a renamed callback is kept
            unused = {"PlacementGroupCleanerCallback"} | (set() if self.datasets else {"DatasetsCallback"})
            return [cb for cb in super()._create_default_callbacks() if type(cb).__name__ not in unused]

    return SatpTrainer
