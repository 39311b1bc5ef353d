"""Loopback ports for the listeners of a Ray node or a test's server, free when picked."""
from __future__ import annotations

import random
import socket
from pathlib import Path

#: the kernel's range for the local ends of outgoing connections (``net.ipv4.ip_local_port_range``)
EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: the lowest port :func:`free_ports` hands out: above Ray's worker ports (``--min-worker-port`` 10002 to
#: ``--max-worker-port`` 19999 by default), which ``ray start`` refuses to see a node's port among
LOWEST_PORT = 20000


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free now, picked at random below the kernel's ephemeral range, where
    no outgoing connection (Ray's gRPC clients) takes one before the listener binds it; a kernel whose
    range starts at or below :data:`LOWEST_PORT` hands them out."""
    try:
        low = int(EPHEMERAL_PORTS.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    pick = random.SystemRandom()
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", pick.randrange(LOWEST_PORT, low) if low > LOWEST_PORT else 0))
            except OSError:  # in use: another pick
                continue
            if s.getsockname()[1] not in ports:
                ports.append(s.getsockname()[1])
    return ports
