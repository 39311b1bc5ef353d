"""The process and the Ray cluster satp runs in, shared by :mod:`preprocessing` and :mod:`pipeline`.

:mod:`~runtime.ray_cluster` connects to Ray (a named cluster, probed first, or a new local one) and
:mod:`~runtime.interrupts` turns SIGINT / SIGTERM into an exception that unwinds and says what was
kept. Both command layers need them and this package imports neither, so every import arrow points
down: ``pipeline`` -> ``preprocessing`` -> ``runtime``.
"""
