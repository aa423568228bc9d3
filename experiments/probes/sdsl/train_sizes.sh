#!/usr/bin/env bash
# SDSL validation: drafts of 1, 3 (= N_opt) and 6 layers for SmolLM2-135M-Instruct, trained
# on the same data with the same token budget (STEPS x BATCH x SEQ tokens each). Resumable:
# re-running continues each run from its last complete checkpoint.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
STEPS=${STEPS:-220}; BATCH=${BATCH:-8}; SEQ=${SEQ:-128}; LR=${LR:-1e-3}; LOSS=${LOSS:-ce}
SIZES=${SIZES:-"auto 3.5M 21.2M"}   # 3, 1, 6 layers (3.54M parameters per layer); add 7.1M for 2 layers
for size in $SIZES; do
  out=checkpoints/sdsl/smollm2-135m-${size}
  resume=(); [ -f "$out/draft.json" ] && resume=(--resume)
  $PY -m ssd_jax.train --target smollm2-135m-instruct --size "$size" --steps "$STEPS" \
      --batch-size "$BATCH" --seq-len "$SEQ" --lr "$LR" --loss "$LOSS" --eval-every 55 \
      --out "$out" "${resume[@]}" --json > "$out.summary.json.tmp" && mv "$out.summary.json.tmp" "$out.summary.json"
done
