#!/usr/bin/env bash
# One device-machine call: install, run the GPU tests, keep the log under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
MEGATRAIN_RESULTS=$OUT python -m pytest -m gpu -q -p no:logging --durations=0 "${@:-tests/gpu}" 2>&1 | tee "$OUT/gpu_tests.log" | grep -v "^  File\|^    " | tail -60
