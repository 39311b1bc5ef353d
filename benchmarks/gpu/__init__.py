"""The GPU check (``benchmarks/gpu/run.sh [PART]`` on a machine with one GPU, ``BENCH=gpu make bench``),
in parts that each fit one device session; :mod:`~benchmarks.gpu.check` picks the part and is the
``perf`` part (parity tests, train-step rows, the pipeline), the others are a module each:
:mod:`~benchmarks.gpu.first`, :mod:`~benchmarks.gpu.steps` (eager vs compiled vs captured steps, start-up),
:mod:`~benchmarks.gpu.scale`, :mod:`~benchmarks.gpu.multirank`, :mod:`~benchmarks.gpu.tune`, and time to
accuracy: :mod:`~benchmarks.gpu.accuracy_sbm` (``pattern``, ``cluster``), :mod:`~benchmarks.gpu.accuracy_code2`
(``code2batch``). One train-step measurement per process: :mod:`~benchmarks.gpu.step`; what the parts
share (budget clock, commands, peak memory): :mod:`~benchmarks.gpu.measure`. The fused message kernels'
launch sweep: ``python -m benchmarks.gpu.messages``. The shell scripts beside them build and install the
wheel kit on a bare image (docs/gpu.md)."""
