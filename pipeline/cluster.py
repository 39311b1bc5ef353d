"""Starting a local Ray cluster safely on a machine that may run other Ray clusters.

``ray.init()`` without an address attaches to a cluster it finds on the machine
(``/tmp/ray/ray_current_cluster`` or a running GCS process): possibly someone
else's. :func:`init_local_ray` always starts a new one (``address="local"``).

Ray Train V2's placement-group cleaner queries the State API of "the" cluster,
resolved the same way: with several clusters on one machine it may ask another
cluster whether our controller is alive, get "no", and remove our placement group
(killing our training). ``RAY_API_SERVER_ADDRESS`` in the job's environment pins
it to our own dashboard (or, without a dashboard, to nothing, so it only warns).
"""
from __future__ import annotations

import socket
from typing import Optional


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_local_ray(num_cpus: Optional[int] = None, dashboard: bool = True, log_to_driver: bool = True,
                   env_vars: Optional[dict] = None) -> None:
    """Start a new local Ray instance (dashboard on 127.0.0.1 when ``dashboard``)."""
    import ray

    port = free_port()
    env = {
        "OUTDATED_IGNORE": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        # dashboard off: an unreachable address makes the cleaner's queries fail (it then only warns)
        "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{port if dashboard else 9}",
        **(env_vars or {}),
    }
    kwargs = dict(address="local", num_cpus=num_cpus, include_dashboard=dashboard, log_to_driver=log_to_driver,
                  runtime_env={"env_vars": env})
    if dashboard:
        kwargs.update(dashboard_host="127.0.0.1", dashboard_port=port)
    ray.init(**kwargs)
