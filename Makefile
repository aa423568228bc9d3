# The two commands of the README:
#   make demo   creates .venv, installs ssd_jax, fetches the default models, prints AR, SD and SSD (its draft in a
#               process of its own) on one prompt in one table
#   make test   creates .venv with the test extras and runs the test suite
#   make lint   ruff's linter and formatter check over the tree (ruff format . fixes the formatting)
#   make kernels  builds the CPU kernels (matmul, attention) into ~/.cache/ssd_jax/kernels (else built on first use)
#   make draft    rebuilds the SmolLM2 draft from scratch by self-distillation (hours on a CPU; rerun to resume)
#   make eagle    trains an EAGLE-style head for SmolLM2 (its own answers and corpus text; rerun to resume)
#   make eagle-qwen  trains the Qwen2.5-Coder-1.5B head from cached target features, corpus then its own answers
#                 (rerun to resume)
#   make sdsl-validate  trains drafts of 5 sizes x 2 seeds on the same distill data and measures them under the
#                 benchmark protocol (many CPU hours; rerun to resume)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-test

.PHONY: demo test lint test-slow test-manual install kernels bench distill-data draft eagle eagle-qwen sdsl-validate clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

kernels: $(STAMP)
	$(PY) -c "from ssd_jax.models import kernels; print(kernels.build(force=True))"

demo: $(STAMP)
	$(PY) -m ssd_jax.demo

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test-slow: $(STAMP)
	$(PY) -m pytest -q -m "slow and not manual" -n 2 --dist loadfile

test-manual: $(STAMP)
	$(PY) -m pytest -q -m manual

# the self-distillation recipe (checkpoints/README.md): target answers at T = 0 and 1 with their top-32
# (length-sorted batches, one device call each, a few compiled prompt widths), then a KL + 0.1 CE run
# on them with sequences packed into the 512-token windows (--pack: each attends to itself only);
# both steps resume where they stopped. DRAFT_OUT is not the shipped
# checkpoints/smollm2-135m-draft: ship a finished run by copying its draft.json, best/ and token_counts.npz.
# The defaults are the recipe of the shipped checkpoints/smollm2-135m-draft (greedy answers to 1024 prompts,
# a head trimmed to 8192 tokens); e.g. DISTILL_TEMPS="0 1" DISTILL_PROMPTS=2048 DRAFT_STEPS=3000 for more.
DRAFT_TARGET ?= smollm2-135m-instruct
DISTILL_PROMPTS ?= 1024
DISTILL_TEMPS ?= 0
DISTILL_DATA ?= runs/distill-$(DRAFT_TARGET)-t$(subst $() ,,$(DISTILL_TEMPS))-$(DISTILL_PROMPTS)
DRAFT_STEPS ?= 600
DRAFT_VOCAB ?= 8192
DRAFT_OUT ?= runs/$(DRAFT_TARGET)-draft-distill
DRAFT_ARGS ?=

distill-data: $(STAMP)
	$(PY) -m ssd_jax.train distill-data --target $(DRAFT_TARGET) --out $(DISTILL_DATA) --n-prompts $(DISTILL_PROMPTS) \
		--temperatures $(DISTILL_TEMPS) --top-k 32 --max-new-tokens 128 --max-prompt-tokens 320 --batch-size 16 --shard-prompts 64

# --keep-evals exports the draft at every evaluation (evals/<step>/, ~42 MB each for 3 layers) for
# `python -m ssd_jax.train learning-curve $(DRAFT_OUT) --out ...`
draft: distill-data
	$(PY) -m ssd_jax.train --target $(DRAFT_TARGET) --size auto --loss distill --ce-weight 0.1 --data $(DISTILL_DATA) \
		--pack --steps $(DRAFT_STEPS) --batch-size 8 --seq-len 512 --lr 5e-4 --eval-every 200 --eval-windows 32 \
		--draft-vocab $(DRAFT_VOCAB) --out $(DRAFT_OUT) --resume --keep-evals $(DRAFT_ARGS)

# an EAGLE-style head (docs/eagle.md): one layer over the target's features. The recipe of the shipped
# checkpoints/smollm2-135m-eagle: the target's greedy answers to 384 training prompts (its own data run,
# about 7 min) in half of each batch, the training corpus's text in the other half, the target's features
# and distributions computed in each step; LM head trimmed to 8192 tokens; 1000 steps. Resumes.
EAGLE_PROMPTS ?= 384
EAGLE_DATA ?= runs/distill-$(DRAFT_TARGET)-t0-$(EAGLE_PROMPTS)
EAGLE_STEPS ?= 1000
EAGLE_OUT ?= runs/$(DRAFT_TARGET)-eagle
EAGLE_ARGS ?=

eagle: $(STAMP)
	$(MAKE) distill-data DISTILL_PROMPTS=$(EAGLE_PROMPTS) DISTILL_TEMPS=0 DISTILL_DATA=$(EAGLE_DATA)
	$(PY) -m ssd_jax.train eagle --target $(DRAFT_TARGET) --data $(EAGLE_DATA) --steps $(EAGLE_STEPS) --batch-size 4 \
		--seq-len 256 --lr 1e-3 --depth 4 --corpus-rows 2 --draft-vocab 8192 --save-every 50 --out $(EAGLE_OUT) \
		--resume $(EAGLE_ARGS)

# the Qwen2.5-Coder-1.5B head (checkpoints/qwen2.5-coder-1.5b-eagle), in two stages, each from cached target
# features (running the target in every step would take ~8 h here): (1) 320 steps over 384 windows of the training
# corpus's text; (2) from (1), 192 steps over the target's greedy answers to 256 training prompts (its own
# data run, ~28 min). MLP 3072 wide, depth 3, LM head trimmed to 8192 tokens, stored in bfloat16. Resumes.
EAGLE_QWEN_OUT ?= runs/qwen-coder-1.5b-eagle
EAGLE_QWEN_PROMPTS ?= 256
EAGLE_QWEN_DATA ?= runs/distill-qwen2.5-coder-1.5b-instruct-t0-$(EAGLE_QWEN_PROMPTS)
EAGLE_QWEN_HEAD := --target qwen2.5-coder-1.5b-instruct --batch-size 4 --seq-len 256 --head-mlp 3072 --depth 3 \
	--draft-vocab 8192 --save-every 40 --save-dtype bfloat16 --resume

eagle-qwen: $(STAMP)
	$(PY) -m ssd_jax.train eagle $(EAGLE_QWEN_HEAD) --steps 320 --corpus-rows 4 --cached-windows 384 --lr 1e-3 \
		--out $(EAGLE_QWEN_OUT)-corpus $(EAGLE_ARGS)
	$(MAKE) distill-data DRAFT_TARGET=qwen2.5-coder-1.5b-instruct DISTILL_PROMPTS=$(EAGLE_QWEN_PROMPTS) \
		DISTILL_TEMPS=0 DISTILL_DATA=$(EAGLE_QWEN_DATA)
	$(PY) -m ssd_jax.train eagle $(EAGLE_QWEN_HEAD) --steps 192 --data $(EAGLE_QWEN_DATA) --cached-windows 256 \
		--lr 5e-4 --init $(EAGLE_QWEN_OUT)-corpus --out $(EAGLE_QWEN_OUT) $(EAGLE_ARGS)

# SDSL validation (issue 14): the law's depth x 1/3, 2/3, 1, 4/3, 2 (SmolLM2: 1, 2, 3, 4, 6 layers), seeds 0 and 1,
# the draft recipe above with SDSL_STEPS steps each (runs in SDSL_RUNS; finished runs are skipped), then AR and
# every draft's SD at K = 4 interleaved under the protocol (4 categories x 8 prompts x 3 repeats, chat template);
# writes $(SDSL_OUT)/{sdsl.md,summary.json,sdsl.png,protocol.jsonl,protocol.md,drafts.json}. Rerun to resume.
SDSL_STEPS ?= 1000
SDSL_RUNS ?= runs/sdsl-$(DRAFT_TARGET)
SDSL_OUT ?= experiments/results/sdsl_$(DRAFT_TARGET)
SDSL_ARGS ?=

sdsl-validate: distill-data
	$(PY) -m ssd_jax.sdsl validate --target $(DRAFT_TARGET) --data $(DISTILL_DATA) --seeds 0 1 --steps $(SDSL_STEPS) \
		--batch-size 8 --seq-len 512 --lr 5e-4 --eval-every 200 --eval-windows 32 --ce-weight 0.1 --k 4 \
		--n-prompts 8 --repeats 3 --new-tokens 64 --runs $(SDSL_RUNS) --out $(SDSL_OUT) $(SDSL_ARGS)

bench: $(STAMP)
	$(PY) -m ssd_jax.bench

clean:
	rm -rf $(VENV) .pytest_cache
