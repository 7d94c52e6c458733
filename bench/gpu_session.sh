#!/usr/bin/env bash
# One device-machine call for this session's GPU evidence: GPU tests, then the host AdamW and
# kernel benchmarks, each bounded so a slow part cannot starve the rest. Logs go to $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(), 'cpus', __import__('os').cpu_count())"
MEGATRAIN_RESULTS=$OUT timeout 330 python -m pytest -m gpu -q -p no:logging --durations=0 "$@" 2>&1 \
  | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|Error|^E |PASS|FAIL|s call" | tail -30
timeout 100 python bench/bench_adamw.py --params 5e8 --repeats 5 --out "$OUT/adamw.jsonl" 2>&1 | tail -12
timeout 90 python bench/bench_kernels.py --tokens 8192 --out "$OUT/kernels.jsonl" 2>&1 | tail -25
