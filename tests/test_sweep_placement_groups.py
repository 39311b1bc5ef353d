"""The placement groups of a sweep's stopped trials, released on Ray's public API.

When ASHA stops a trial, Tune ends its actor, which takes its Train controller and workers with it,
but Ray keeps their placement group until the job ends. The sweep's driver releases such groups
(:func:`pipeline.sweep.trials.release_orphaned_placement_groups`) without Ray's private modules:
a group of its job that it saw in use and that is entirely free now. Here on the session's cluster,
with a creator actor standing in for a trial's Train controller (it creates the group and owns the
worker actor in it, so the worker dies with it, as Train's do): the group of a killed creator is
released, a live one's stays, one never in use stays, and another job's stays even once it is free.
(A whole sweep's, ASHA stopping a trial: ``tests/test_tune_sweep.py``.)
"""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRIVATE_RAY = ("ray._private", "ray._raylet", "ray.core.generated", "ray.train.v2._internal")


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_the_sweep_modules_use_rays_public_api_only():
    paths = [*sorted((ROOT / "pipeline" / "sweep").glob("*.py")), ROOT / "pipeline" / "cli" / "sweep_commands.py"]
    private = {f"{path.relative_to(ROOT)}: {name}" for path in paths for name in _imports(path)
               if any(name == p or name.startswith(p + ".") for p in PRIVATE_RAY)}
    assert not private, sorted(private)


def _dead(ray, actor) -> bool:
    try:
        ray.get(actor.ping.remote(), timeout=10)
    except ray.exceptions.RayActorError:
        return True
    return False


OTHER_JOB = textwrap.dedent('''
    import sys
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray.init(address=sys.argv[1], log_to_driver=False)
    group = placement_group([{"CPU": 0.5}])
    ray.get(group.ready())
    held = ray.remote(num_cpus=0.5)(type("Held", (), {"ping": lambda self: 1})).options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0)).remote()
    ray.get(held.ping.remote())
    print(group.id.hex(), flush=True)
    sys.stdin.readline()
    ray.kill(held)
    print("freed", flush=True)
    sys.stdin.readline()
''')


def _in_use(ray, group_id: str) -> bool:
    total, free = ray.cluster_resources(), ray.available_resources()
    return any(free.get(key, 0.0) < amount for key, amount in total.items() if key.endswith(f"_group_{group_id}"))


def _wait(condition, what: str, timeout: float = 60) -> None:
    """A liveness bound: Ray's view of the resources follows its processes' within a second or so."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(0.2)


@pytest.mark.ray
def test_a_dead_creators_group_is_released_and_the_others_stay(ray_cluster):
    import ray
    from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

    from pipeline.sweep.trials import release_orphaned_placement_groups

    @ray.remote(num_cpus=0.5)
    class Worker:
        def ping(self) -> int:
            return 1

    @ray.remote(num_cpus=0)
    class Creator:
        """What a trial's Train controller does: a group, and a worker in it that it owns."""

        def start(self) -> str:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            group = placement_group([{"CPU": 0.5}])
            ray.get(group.ready())
            self.worker = Worker.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0)).remote()
            ray.get(self.worker.ping.remote())
            return group.id.hex()

        def worker_handle(self):
            return [self.worker]

    other = subprocess.Popen([sys.executable, "-c", OTHER_JOB, ray_cluster.get_runtime_context().gcs_address],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    stopped, live = Creator.remote(), Creator.remote()
    unused = placement_group([{"CPU": 0.25}])  # created, nothing in it yet (a Train run starting)
    made = []
    try:
        others = other.stdout.readline().strip()
        assert others, "the other job's driver ended"
        stopped_group, live_group = made = ray.get([stopped.start.remote(), live.start.remote()])
        ray.get(unused.ready())
        [stopped_worker] = ray.get(stopped.worker_handle.remote())
        _wait(lambda: _in_use(ray, stopped_group) and _in_use(ray, live_group) and _in_use(ray, others),
              "groups in use in Ray's view")
        assert release_orphaned_placement_groups() == (0, 2)  # this job's two in use

        ray.kill(stopped)  # as Tune ends a stopped trial's actor: its worker goes with it
        # the owner's death reaches its worker a moment later: a ping may still be answered until then
        _wait(lambda: _dead(ray, stopped_worker), "the killed creator's worker gone with it")
        other.stdin.write("\n")
        other.stdin.flush()
        assert other.stdout.readline().strip() == "freed"
        _wait(lambda: not _in_use(ray, stopped_group) and not _in_use(ray, others), "free groups in Ray's view")

        assert release_orphaned_placement_groups() == (1, 1)
        table = placement_group_table()
        assert table[stopped_group]["state"] == "REMOVED"
        assert table[live_group]["state"] == "CREATED" and _in_use(ray, live_group)
        assert table[unused.id.hex()]["state"] == "CREATED"
        assert table[others]["state"] == "CREATED"  # another job's: never touched
        assert release_orphaned_placement_groups() == (0, 1)
    finally:
        other.stdin.close()
        other.wait(timeout=60)
        ray.kill(live)
        for group in [unused, *(PlacementGroup(ray.PlacementGroupID.from_hex(g)) for g in made)]:
            remove_placement_group(group)  # removing a removed group does nothing
