#!/usr/bin/env bash
# Issue 6's depth sweep: megatrain at 8, 16, 32, 64 layers of the 1.3B width (hidden 2048,
# ffn 5504), one bench/train.py run (one probe, one child per depth, rows appended as each
# finishes), then the depth table from the rows: step s, s per layer, tokens/s, peak GPU
# GiB and its ratio to the shallowest depth (flat within 10% is the claim), host B/param.
#   bash bench/depth_sweep.sh [more bench/train.py args]
# Env: MODEL (1.3b: the width), LAYERS (8,16,32,64), TOKENS (16384), GPU_MEMORY (12GiB),
# STEPS (7), WARMUP (2; 5 timed steps: with 3 the 32-layer median of session 21 swung
# 0.755-0.935 s), RESULTS (jsonl; default $OUT/train.jsonl, else
# bench/results/train.jsonl), SWEEP_TIMEOUT (s, 540).
# Duration, estimated: Inductor compiles the whole graph, ~75 s at 24 layers on the H200,
# roughly in proportion to depth (on CPU, tiny model: 30 / 47 / 108 s at 8 / 16 / 32 layers,
# backward a little worse than linear). So 8+16+32+64 = 120 layers is ~6-7 min of compiling,
# plus ~15 s a child to start and build the model, the probe (~15 s) and ~0.033 s/layer a
# step: ~7-8 min, near the 10-minute device call. SWEEP_TIMEOUT stops the runs in time for
# the table (rows already appended stay). Safer: LAYERS=8,16,32 in one call, LAYERS=64 in a
# second, then append both calls' rows to one file and print the table from it with
#   python bench/readme_table.py --depth --file FILE --model 1.3b --tokens 16384 --gpu-memory 12GiB
# (the latest row per depth, across runs).
set -o pipefail
export PYTHONUNBUFFERED=1
results=${RESULTS:-${OUT:+$OUT/train.jsonl}}
results=${results:-bench/results/train.jsonl}
timeout "${SWEEP_TIMEOUT:-540}" python bench/train.py --model "${MODEL:-1.3b}" --systems megatrain \
  --layers "${LAYERS:-8,16,32,64}" --tokens "${TOKENS:-16384}" --gpu-memory "${GPU_MEMORY:-12GiB}" \
  --steps "${STEPS:-7}" --warmup "${WARMUP:-2}" --out "$results" "$@" 2>&1 | grep -v '^{'
python bench/readme_table.py --depth --file "$results" --model "${MODEL:-1.3b}" --tokens "${TOKENS:-16384}" \
  --gpu-memory "${GPU_MEMORY:-12GiB}"
