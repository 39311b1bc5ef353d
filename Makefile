# The README's two commands: `make demo` (the main job end to end, locally) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch by pip, which reads the machine's pip configuration (a local wheel, a mirror); the rest by uv from
# PyPI (UV_INDEX_URL names a mirror), which resolves and installs its ~150 packages in parallel: ~20 s
# against pip's ~70 s on 2 cores. Without an NVIDIA GPU take PyTorch's CPU build (a plain `torch`
# resolves to a CUDA build).
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

export OUTDATED_IGNORE := 1
export DS_ACCELERATOR := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: install test demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip uv
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m uv pip install --quiet --compile-bytecode --python $(PY) -e ".[dev]"
	touch $(STAMP)

test: install
	$(PY) -m pytest -q tests --durations=30 --beside

demo: install
	$(PY) -m pipeline.cli demo

bench: install
	$(PY) -m benchmarks.run

clean:
	rm -rf runs .pytest_cache
