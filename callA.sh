set -x
mkdir -p /tmp/t && tar xf clean.tar -C /tmp/t && cd /tmp/t && python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total --format=csv
cd /tmp/t && python bench/hf_train.py --model qwen2-1.5b --systems resident-compiled,megatrain --steps 8 --warmup 3 --timeout 280 --out $OUT/hf.jsonl 2>&1 | tail -40
