PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test bench fuzz clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# CPU wheel from local disk; never let pip pick a CUDA build of torch.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]' torch==2.13.0
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m pip install --quiet matplotlib ai2-olmo-core==0.1.0 torch==2.13.0
	$(PY) benchmarks/compare.py
	$(PY) benchmarks/plan_scale.py
	$(PY) benchmarks/tp_compare.py

fuzz: $(STAMP)
	CHECKPOINTER_FUZZ_EXAMPLES=20000 $(PY) -m pytest -q tests/reliability -k fuzz

clean:
	rm -rf $(VENV) demo_out .pytest_cache .hypothesis
