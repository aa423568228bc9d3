# The two commands of the README:
#   make demo   creates .venv, installs ssd_jax, fetches the default model, generates text
#   make test   creates .venv with the test extras and runs the test suite
#   make kernels  builds the CPU matmul kernel into ~/.cache/ssd_jax/kernels (else built on first use)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-test

.PHONY: demo test test-slow install kernels bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

kernels: $(STAMP)
	$(PY) -c "from ssd_jax.models import kernels; print(kernels.build(force=True))"

demo: $(STAMP)
	$(PY) -m ssd_jax.decode

test: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

bench: $(STAMP)
	$(PY) -m ssd_jax.bench

clean:
	rm -rf $(VENV) .pytest_cache
