#!/usr/bin/env bash
# The GPU check (issue 13, item 5) in one command, for a bare machine: jax 0.11, python3, no network,
# no carried weights. It builds random-weight Qwen2.5-1.5B / 0.5B-shaped bf16 HF folders itself, then
# times the engine loops (AR; SD and SSD with draft = target and with an unrelated draft), an HBM
# bandwidth probe, SSD build vs verify and host time per round; then (issue 48) exactness apart from
# numerics in f32 and bf16, AR with and without XLA's command buffers, and the round-cost benchmark's
# one-device layout; every step under a timeout, the whole run under 480 s (--budget-s). Results:
# $OUT/gpu_check.{json,md} and gpu_check.log (the device tool brings $OUT back), else
# experiments/results/gpu/. Details: tools/gpu_check.py.
#
#   bash experiments/gpu_check.sh            # on the GPU machine
#   bash experiments/gpu_check.sh --smoke    # same code path on CPU, tiny shapes (run by tests/test_gpu_check.py)
#
# STATUS: not yet run on a GPU (no GPU was lent to the session that wrote it).
set -u
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" tools/gpu_check.py "$@"
