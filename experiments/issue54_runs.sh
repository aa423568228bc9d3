#!/usr/bin/env bash
# Issue 54's measurements, one after the other on a quiet machine (the benchmarks would measure each other):
# the kernel benchmark (every build and XLA), then the protocol on the AVX2-only build and on the native one,
# the hardware-fair SmolLM2 SD / SSD protocol on the AVX2-only build, and the demo on it. The AVX2-only runs
# also limit XLA's own code generation to AVX2 (--xla_cpu_max_isa), so they stand for an AVX2-only CPU.
#   bash experiments/issue54_runs.sh [STEP...]   (steps: kernels protocol fair demo; default all)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=experiments/results/issue54
mkdir -p "$OUT"
steps=("${@:-kernels protocol fair demo}")
want() { [[ " ${steps[*]} " == *" $1 "* ]]; }
log() { echo "[$(date -u +%H:%M:%S)] $*" >&2; }

if want kernels; then
  log kernels
  $PY -m ssd_jax.bench.kernels --reps 5 --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/kernels.log"
fi
if want protocol; then
  for isa in avx2 native; do
    xla=""; [[ $isa == avx2 ]] && xla="--xla_cpu_max_isa=AVX2"  # XLA's own code generation as on an AVX2 CPU
    log "protocol qwen $isa"
    SSD_JAX_KERNEL_ISA=$isa XLA_FLAGS="$xla" $PY -m ssd_jax.bench --suite protocol --target qwen2.5-coder-1.5b-instruct \
      --draft qwen2.5-coder-0.5b-instruct --methods ar sd:auto --categories code --n-prompts 8 --repeats 3 \
      --new-tokens 32 --batch-sizes 1 --chat --out "$OUT" --tag "qwen_sd_code_$isa" 2>&1 | tail -3
    log "protocol smollm2 $isa"
    SSD_JAX_KERNEL_ISA=$isa XLA_FLAGS="$xla" $PY -m ssd_jax.bench --suite protocol --target smollm2-135m-instruct \
      --draft smollm2-135m-eagle --methods ar sd:auto --categories code chat math copy --n-prompts 8 \
      --repeats 3 --new-tokens 48 --batch-sizes 1 --chat --out "$OUT" --tag "smollm2_sd_head_$isa" 2>&1 | tail -3
  done
fi
if want fair; then
  log "fair smollm2 avx2"
  SSD_JAX_KERNEL_ISA=avx2 XLA_FLAGS=--xla_cpu_max_isa=AVX2 $PY -m ssd_jax.launch --processes 2 --devices-per-process 1 --cpus-per-process 1 bench \
    --suite protocol --target smollm2-135m-instruct --draft smollm2-135m-draft --methods ar sd:auto ssd:auto \
    --categories code chat --n-prompts 8 --repeats 3 --chat --new-tokens 48 --out "$OUT" \
    --tag smollm2_b1_fair_avx2 2>&1 | tail -3
fi
if want demo; then
  log "demo avx2"
  SSD_JAX_KERNEL_ISA=avx2 XLA_FLAGS=--xla_cpu_max_isa=AVX2 $PY -m ssd_jax.demo 2>&1 | grep -v Warning | tail -12 | tee "$OUT/demo_avx2.txt"
fi
log done
