# The two commands of the README:
#   make demo   creates .venv, installs ssd_jax, fetches the default model, generates text
#   make test   creates .venv with the test extras and runs the test suite
#   make kernels  builds the CPU matmul kernel into ~/.cache/ssd_jax/kernels (else built on first use)
#   make draft    rebuilds the SmolLM2 draft from scratch by self-distillation (hours on a CPU; rerun to resume)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-test

.PHONY: demo test test-slow install kernels bench draft clean

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
	$(PY) -m pytest -q -n 2 --dist loadfile

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# the self-distillation recipe (checkpoints/README.md): target answers at T = 0 and 1 with their top-32
# (length-sorted batches, one device call each, a few compiled prompt widths), then a KL + 0.1 CE run
# on them with sequences packed into the 512-token windows (--pack: each attends to itself only);
# both steps resume where they stopped. DRAFT_OUT is not the shipped
# checkpoints/smollm2-135m-draft: ship a finished run by copying its draft.json, best/ and token_counts.npz.
DRAFT_TARGET ?= smollm2-135m-instruct
DISTILL_DATA ?= runs/distill-$(DRAFT_TARGET)
DISTILL_PROMPTS ?= 2048
DRAFT_STEPS ?= 3000
DRAFT_OUT ?= runs/$(DRAFT_TARGET)-draft-distill
DRAFT_ARGS ?=

draft: $(STAMP)
	$(PY) -m ssd_jax.train distill-data --target $(DRAFT_TARGET) --out $(DISTILL_DATA) --n-prompts $(DISTILL_PROMPTS) \
		--temperatures 0 1 --top-k 32 --max-new-tokens 128 --max-prompt-tokens 320 --batch-size 16 --shard-prompts 64
	$(PY) -m ssd_jax.train --target $(DRAFT_TARGET) --size auto --loss distill --ce-weight 0.1 --data $(DISTILL_DATA) \
		--pack --steps $(DRAFT_STEPS) --batch-size 8 --seq-len 512 --lr 5e-4 --eval-every 200 --eval-windows 32 \
		--out $(DRAFT_OUT) --resume $(DRAFT_ARGS)

bench: $(STAMP)
	$(PY) -m ssd_jax.bench

clean:
	rm -rf $(VENV) .pytest_cache
