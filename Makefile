PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test bench fuzz clean install-torchtitan-deps test-torchtitan bench-torchtitan

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

# The torchtitan extra in a venv of its own (torchtitan pins packages the main test venv does not
# want). Every pip command is held to the CPU torch 2.13.0; triton (--no-deps) is imported by
# torchtitan's trainer but never run on CPU; wandb, which torchtitan lists, is not needed.
TITAN_VENV := .venv-titan
TITAN_PY := $(TITAN_VENV)/bin/python
TITAN_STAMP := $(TITAN_VENV)/.installed
TITAN_DEPS := $(TITAN_VENV)/.deps-installed

# Everything but this project, which CI installs while the main tests run (.ci/run).
$(TITAN_DEPS): Makefile
	$(PYTHON) -m venv $(TITAN_VENV)
	echo "torch==2.13.0" > $(TITAN_VENV)/constraints.txt
	$(TITAN_PY) -m pip install --quiet -c $(TITAN_VENV)/constraints.txt torch==2.13.0
	$(TITAN_PY) -m pip install --quiet --no-deps torchtitan==0.3.0 triton
	$(TITAN_PY) -m pip install --quiet -c $(TITAN_VENV)/constraints.txt torchdata torch_checkpointing \
		'datasets>=3.6.0,<4.8.0' 'tokenizers>=0.15.0' safetensors tyro tensorboard einops pillow spmd_types==0.2.3 \
		pytest pytest-timeout
	touch $(TITAN_DEPS)

$(TITAN_STAMP): pyproject.toml Makefile $(TITAN_DEPS)
	$(TITAN_PY) -m pip install --quiet -c $(TITAN_VENV)/constraints.txt -e .
	touch $(TITAN_STAMP)

install-torchtitan-deps: $(TITAN_DEPS)

test-torchtitan: $(TITAN_STAMP)
	$(TITAN_PY) -m pytest -q tests/integration

bench-torchtitan: $(TITAN_STAMP)
	$(TITAN_PY) benchmarks/torchtitan_compare.py

clean:
	rm -rf $(VENV) $(TITAN_VENV) demo_out .pytest_cache .hypothesis .titan-install.log .titan-test.log
