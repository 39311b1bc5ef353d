"""Not a measurement: the graphs the benchmarks (and tests) run on. :mod:`~benchmarks.graphs.synthetic`:
code2- and ppa-shaped synthetic graphs (ogbg-code2's and ogbg-ppa's size distributions); :mod:`~benchmarks.graphs.jobs`:
graphs laid out as any job file's shards hold them, with the job's task and model config."""
