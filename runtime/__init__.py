"""The process and the Ray cluster satp runs in, shared by :mod:`preprocessing` and :mod:`pipeline`
(this package imports neither: ``pipeline`` -> ``preprocessing`` -> ``runtime``).
"""
