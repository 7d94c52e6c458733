#!/usr/bin/env bash
# One device-machine call: the GPU tests, then the side-by-side training benchmark, each
# bounded so a slow part cannot starve the rest; logs and rows go to $OUT.
#   bash bench/gpu_session.sh [pytest targets]        (default: tests/gpu tests/kernels)
# Env: TEST_TIMEOUT (s, default 240), TRAIN_TIMEOUT (s, default 300), TRAIN_ARGS (replaces
# the default bench/train.py arguments), MEGATRAIN_COMMIT (recorded in the rows).
# Run it from a tree with no uncommitted work of others in it: copy `git archive HEAD`.
set -o pipefail
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(), 'cpus', __import__('os').cpu_count())"
MEGATRAIN_RESULTS=$OUT timeout "${TEST_TIMEOUT:-240}" python -m pytest -m gpu -q -p no:logging \
  --tb=short --durations=0 ${@:-tests/gpu tests/kernels} 2>&1 | tee "$OUT/gpu_tests.log" \
  | grep -E "passed|failed|^E |^FAILED" | tail -30
# shellcheck disable=SC2086
timeout "${TRAIN_TIMEOUT:-300}" python bench/train.py --out "$OUT/train.jsonl" \
  ${TRAIN_ARGS:---model 1.3b --tokens 16384 --gpu-memory 12GiB --systems megatrain,resident-compiled --profile $OUT} \
  2>&1 | grep -v '^{' | tail -25
