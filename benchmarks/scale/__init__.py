"""The data path at dataset scale (``BENCH=scale make bench``, ``python -m benchmarks.scale.data_path``):
``satp data synthetic-ppa`` and ``satp preprocess jobs/ppa.yaml`` at several sizes up to the full
ogbg-ppa, with wall time, peak RSS of every process, a killed and resumed run, and disk use
(:mod:`~benchmarks.scale.data_path`). The GPU machine's own scale run is a GPU check part
(:mod:`benchmarks.gpu.scale`)."""
