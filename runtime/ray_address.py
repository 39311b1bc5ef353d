"""Which Ray cluster a command names, and whether it answers as one, in seconds (``ray.init`` on a
dead address retries for a minute, then fails with a traceback).
"""
from __future__ import annotations

import os
import socket
from typing import Optional
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 5.0


def resolve_address(address: Optional[str]) -> Optional[str]:
    """The cluster to connect to: ``address``, else ``$RAY_ADDRESS``, else None (a new local one)."""
    return address or os.environ.get("RAY_ADDRESS") or None


def probe(address: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Raise ``ValueError`` (one line) unless ``address`` answers as a Ray cluster within ~2 x ``timeout``.

    ``address``: ``host:port`` (a GCS), ``ray://host:port`` or ``http(s)://host:port``; ``auto``
    and ``local`` are left to Ray. First a TCP connection; then, for a GCS address, the port must
    answer HTTP/2 (:func:`_grpc_problem`) and the GCS its cluster's id (:func:`_gcs_problem`)."""
    if address in ("auto", "local"):
        return
    parsed = urlparse(address if "://" in address else f"tcp://{address}")
    host, port = parsed.hostname, parsed.port
    if not host or not port:
        raise ValueError(f"--address {address}: expected host:port (e.g. 127.0.0.1:6379) or ray://host:port")
    advice = "start it (ray start --head) or leave --address out to run on a new local Ray"
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        reason = "timed out" if isinstance(exc, socket.timeout) else (exc.strerror or str(exc) or type(exc).__name__)
        raise ValueError(f"cannot reach the Ray cluster at {address} ({reason}); {advice}") from None
    if parsed.scheme == "tcp":
        problem = _grpc_problem(host, port, timeout) or _gcs_problem(f"{host}:{port}", timeout)
        if problem:
            raise ValueError(f"cannot reach the Ray cluster at {address} ({problem}); {advice}")


#: What an HTTP/2 client sends first (RFC 9113 3.4), with an empty SETTINGS frame.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def _grpc_problem(host: str, port: int, timeout: float) -> Optional[str]:
    """None when ``host:port`` answers HTTP/2's connection preface with a SETTINGS frame, as Ray's
    GCS (gRPC) does, or speaks TLS (``RAY_USE_TLS``: left to Ray); else what answered instead."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return None
    first = b""
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            conn.sendall(_H2_PREFACE)
            while len(first) < 9 and (chunk := conn.recv(9 - len(first))):  # a frame header
                first += chunk
    except socket.timeout:
        if not first:
            return f"no answer within {timeout:g} s"
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__
    if len(first) >= 4 and first[3] == 4:  # frame type 4: SETTINGS
        return None
    if not first:
        return "it answers, but not as a Ray cluster: it closed the connection"
    if first[:5] == b"HTTP/" or first.lstrip()[:1] == b"<":
        return "it answers, but not as a Ray cluster: it is an HTTP server; a dashboard address is for satp submit"
    return f"it answers, but not as a Ray cluster: it replied {first!r}"


#: a method every Ray GCS answers (an empty request: its message has no required field)
GCS_METHOD = "/ray.rpc.NodeInfoGcsService/GetClusterId"


def _gcs_problem(address: str, timeout: float) -> Optional[str]:
    """None when a Ray GCS answers :data:`GCS_METHOD` at ``address`` within ``timeout`` (an
    authentication error counts as an answer: ``ray.init`` then says what is missing), else what went wrong."""
    import grpc

    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(GCS_METHOD, request_serializer=None, response_deserializer=None)
        try:
            call(b"", timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.UNAUTHENTICATED:
                return None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                return f"no answer from a Ray GCS within {timeout:g} s"
            details = exc.details() or str(code)
            return f"it answers, but not as a Ray cluster: {details.strip().splitlines()[0]}"
    return None
