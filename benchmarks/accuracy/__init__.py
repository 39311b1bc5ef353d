"""Time to accuracy on the CPU: the batch-size study (``BENCH=batch``, :mod:`~benchmarks.accuracy.batch`):
per global batch an ASHA lr sweep and more seeds through ``satp tune`` / ``satp compare``, F1 against
wall-clock and steps, the critical batch size. Time to accuracy on a GPU is a GPU check part
(``benchmarks/gpu/run.sh pattern``, docs/gpu.md)."""
