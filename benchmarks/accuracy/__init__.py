"""Time to accuracy on the CPU: the batch-size study (``BENCH=batch``,
``python -m benchmarks.accuracy.batch``): per global batch an ASHA lr sweep and more seeds through
``satp tune`` / ``satp compare``, F1 against wall-clock and steps, the critical batch size. Its job
files (:mod:`~benchmarks.accuracy.batch_jobs`), the analysis of its runs
(:mod:`~benchmarks.accuracy.batch_analysis`) and its section and plots
(:mod:`~benchmarks.accuracy.batch_report`). Time to accuracy on a GPU is a GPU check part
(:mod:`benchmarks.gpu.accuracy`)."""
