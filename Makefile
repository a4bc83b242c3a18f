VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1

.PHONY: demo test test-slow bench gpu-check clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m partitioner compile examples/gpt.py --out build/gpt --stages 2 --schedule 1f1b --optimizer sgd
	$(PY) -m partitioner show build/gpt
	$(PY) -m partitioner run build/gpt --nproc 2 --steps 5

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks

gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py

clean:
	rm -rf build $(VENV)
