#!/usr/bin/env bash
# One device-machine call: training benchmarks first (alone on the GPU, so their timings
# are clean), then the GPU tests in parallel groups (correctness only; compiling dominates,
# so groups share the CPUs and the GPU). Every part is bounded so a slow one cannot starve
# the rest; logs, rows and profiles go to $OUT.
#   bash bench/gpu_session.sh
# Env:
#   TRAIN_RUNS     bench/train.py argument sets, one per line, run in order (default:
#                  1.3B at 16k tokens, megatrain with its defaults beside resident compiled
#                  and beside itself forced to recompute every region; ~330 s on a fresh
#                  machine); "" skips
#   TRAIN_TIMEOUT  s per train run (default 540)
#   TEST_GROUPS    pytest target groups separated by ';', run in parallel (default: the
#                  backend's equality tests, its memory tests, its offloaded-activations test
#                  alone (it did not finish inside the memory group's 540 s, session 21),
#                  kernels + streamer + device
#                  updates + gradient ring + kept weights + resident state + backlog + the joint
#                  passes' memory; the zoo, all passed, is left out); "" skips
#   TEST_TIMEOUT   s for the test groups together (default 540: at 360 the backend's
#                  group did not finish, session 20)
#   MEGATRAIN_COMMIT  recorded in the rows
#   WHEELS         a folder of carried wheels installed first (--target /tmp/site, on
#                  PYTHONPATH): DeepSpeed and what it needs for zero3-offload (NOTES.md,
#                  session 10); e.g. WHEELS=$PWD/.whl before cd-ing into the unpacked tree
#                  (bench/zero3_wheels.sh builds .whl on the dev machine)
# The device tool brings back at most 8 files from $OUT: on exit (also when a `timeout`
# around this script ends it), everything but the rows and logs goes into one extras.tgz.
# Run it from a tree with no uncommitted work of others in it: copy `git archive HEAD` to
# clean.tar (git-ignored, so the device tool needs carry=["clean.tar"]) and unpack it there.
set -o pipefail
export PYTHONUNBUFFERED=1
pack() {
  (cd "$OUT" && if ls tests_*.log >/dev/null 2>&1; then cat tests_*.log > gpu_tests.log; rm -f tests_*.log; fi
   extras=$(ls | grep -v -E '^(train|backend_gpu)\.jsonl$|^gpu_tests\.log$|^session\.log$|^extras\.tgz$')
   [ -n "$extras" ] && tar czf extras.tgz $extras && rm -rf $extras) || true
}
trap pack EXIT
trap 'exit 143' TERM
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl 2>&1 | tail -3
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
python -c "import torch, triton, megatrain; assert 'megatrain' in torch._dynamo.list_backends(), 'backend not registered: the install failed'; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(), 'cpus', __import__('os').cpu_count())" || exit 1

default_run="--model 1.3b --tokens 16384 --systems resident-compiled,megatrain,megatrain+keep-activations=off --steps 8 --warmup 3"
n=0
while IFS= read -r run; do
  [ -z "$run" ] && continue
  n=$((n + 1))
  echo "== bench/train.py $run"
  # the whole output (the pinned watch's stacks too) goes to extras; the log shows the
  # progress lines and the table, which the stacks used to push out of a plain tail
  # shellcheck disable=SC2086
  timeout "${TRAIN_TIMEOUT:-540}" python bench/train.py --out "$OUT/train.jsonl" $run 2>&1 \
    | tee "$OUT/train_run$n.out" | grep -v '^{' | grep -v '^ *thread ' | grep -v '^  [a-z0-9+=-]* step [0-9]' | tail -40
done <<< "${TRAIN_RUNS-$default_run}"

default_groups="tests/gpu/test_backend_cuda.py -k 'fp32 or bf16';tests/gpu/test_backend_cuda.py -k 'not fp32 and not bf16 and not offloaded';tests/gpu/test_backend_cuda.py -k offloaded;tests/kernels tests/gpu/test_streamer_cuda.py tests/gpu/test_device_update_cuda.py tests/gpu/test_grad_ring_cuda.py tests/gpu/test_keep_weights_cuda.py tests/gpu/test_resident_cuda.py tests/gpu/test_backlog_cuda.py tests/compiler/test_joint_passes.py"
IFS=';' read -ra groups <<< "${TEST_GROUPS-$default_groups}"
for i in "${!groups[@]}"; do
  # eval: a group may quote its arguments (-k 'a or b')
  eval "MEGATRAIN_RESULTS=\$OUT timeout \"\${TEST_TIMEOUT:-540}\" python -m pytest -m gpu -v -rxX \
    -p no:logging --tb=short ${groups[$i]}" > "$OUT/tests_$i.log" 2>&1 &
done
wait
if [ "${#groups[@]}" -gt 0 ]; then
  cat "$OUT"/tests_*.log > "$OUT/gpu_tests.log" && rm -f "$OUT"/tests_*.log
  grep -E "PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED|^E  " "$OUT/gpu_tests.log" | cut -c1-200 | tail -60
fi
