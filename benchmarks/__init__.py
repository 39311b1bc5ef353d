"""The project's benchmarks, in rooms by what they measure; ``make bench`` (``benchmarks/run.py``) runs
the CPU areas and appends their sections to ``benchmarks/RESULTS.md``, ``BENCH=...`` picks areas.

* :mod:`benchmarks.cpu`: throughput and step cost on the CPU (``make bench``'s default areas);
* :mod:`benchmarks.scale`: the data path at dataset scale: time, memory, disk (``BENCH=scale``);
* :mod:`benchmarks.accuracy`: time to accuracy on the CPU, the batch-size study (``BENCH=batch``);
* :mod:`benchmarks.gpu`: the GPU check and its parts (``benchmarks/gpu/run.sh [PART]``, ``BENCH=gpu``);
* :mod:`benchmarks.graphs`: not a measurement: the synthetic and job-shaped graphs the others (and
  the tests) run on; :mod:`benchmarks.machine`: the machine line every section states.

Benchmarks import the product (``sat``, ``runtime``, ``preprocessing``, ``pipeline``), never the
reverse, and no room imports a room it is imported by (``tests/test_layering.py``).
"""
from runtime.command import set_command_environment

set_command_environment()  # as every satp command: a local Ray on 127.0.0.1 (Ray reads it when it is imported)
