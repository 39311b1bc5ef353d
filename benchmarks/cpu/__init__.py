"""Throughput and step cost on the CPU: ``make bench``'s default areas (``BENCH=model,preprocessing,
training,loader,step``), each a module with ``run() -> str``:

* :mod:`~benchmarks.cpu.model`: the product's training step on code2-shaped batches (graphs/s, peak RSS)
  against the SAT authors' figures;
* :mod:`~benchmarks.cpu.preprocessing`: shard computation per core and on Ray;
* :mod:`~benchmarks.cpu.training`: Ray Train + DeepSpeed graphs/s with 1 and 2 workers, data wait;
* :mod:`~benchmarks.cpu.loader`: the training DataLoader alone;
* :mod:`~benchmarks.cpu.step`: operators and host time per step, eager vs padded vs compiled, the
  product's trainer stepped in one process (:mod:`~benchmarks.cpu.model` times its steps the same way).
"""
