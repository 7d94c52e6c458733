#!/usr/bin/env bash
# Build the wheels the GPU image lacks for the bench's zero3-offload system (DeepSpeed
# 0.19.8, the issue's version, and what it imports) into .whl/ (git-ignored), for
# gpu_session.sh's WHEELS (carry [".whl", "clean.tar"]). DeepSpeed is pure Python with
# DS_BUILD_OPS=0; its CPU Adam JIT-builds there with the image's ninja. The other wheels
# are for the GPU image's Python (3.12, manylinux x86_64). bench/results/NOTES.md, session 10.
#   bash bench/zero3_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
DS_BUILD_OPS=0 python -m pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w .whl
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform any -d .whl \
  hjson pydantic pydantic-core==2.50.5 annotated-types typing-inspection "typing-extensions>=4.16"
ls .whl
